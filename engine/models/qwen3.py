"""Qwen3 (dense): the Llama layout plus an RMSNorm over each head's q and k before rope
(ModelConfig.qk_norm), an explicit head_dim (not hidden / heads), no q/k/v bias unless
`attention_bias` (then q/k/v/o, as transformers builds it), tied or untied embeddings, Qwen's sliding
window rule and YaRN rope."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import dense_weights
from engine.models.layers import CausalLM, dense_mlp


def config(raw: dict) -> ModelConfig:
    """config.json of a Qwen3 model."""
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not qwen3")
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig.from_hf(raw, qkv_bias=bias, o_bias=bias, qk_norm=True)


class Model(CausalLM):
    """The Qwen3 decoder: q/k norms (from cfg.qk_norm), dense SwiGLU MLP on every layer."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp, dense_mlp)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names -> Model's (q_norm/k_norm whole, the rest as the Llama family), sliced for tp.rank."""
    return dense_weights(raw, cfg, tp)
