"""Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2/2.5 (q/k/v bias), on the shared layers (layers.py).

Sliding windows: Mistral's on every layer, Qwen2's from `max_window_layers` on (ModelConfig.window).
Rope: default, linear, llama3, YaRN (engine/models/rope.py).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import dense_weights
from engine.models.layers import CausalLM, ForwardContext, RotaryTables, dense_mlp

__all__ = ["ForwardContext", "LlamaForCausalLM", "Model", "RotaryTables", "config", "weights"]

MODEL_TYPES = ("llama", "mistral", "qwen2")


def config(raw: dict) -> ModelConfig:
    """config.json of a Llama, Mistral or Qwen2 model. Biases as transformers builds them: Qwen2 q/k/v
    always; Llama q/k/v/o when `attention_bias`; Mistral none. `mlp_bias` is refused."""
    mtype = raw.get("model_type", "llama")
    if mtype not in MODEL_TYPES:
        raise ValueError(f"config.json field 'model_type' ({mtype!r}) is not a Llama-family model")
    if raw.get("mlp_bias"):
        raise ValueError("config.json field 'mlp_bias' (true) is not supported by this engine")
    bias = mtype == "llama" and bool(raw.get("attention_bias", False))
    return ModelConfig.from_hf(raw, qkv_bias=mtype == "qwen2" or bias, o_bias=bias)


class Model(CausalLM):
    """The Llama decoder: dense SwiGLU MLP on every layer."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp, dense_mlp)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names -> Model's (q/k/v fused into qkv_proj, gate/up into gate_up_proj), sliced for tp.rank."""
    return dense_weights(raw, cfg, tp)


LlamaForCausalLM = Model  # the name before the registry
