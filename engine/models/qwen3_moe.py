"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): the Qwen3 decoder (per-head q/k RMSNorm before rope, explicit
head_dim, biases per `attention_bias`) with a sparse MoE MLP on the layers `decoder_sparse_step` /
`mlp_only_layers` choose: softmax router -> top-k -> renormalised when `norm_topk_prob`, no shared
expert (engine/models/moe.py). `sliding_window` applies to every layer when `use_sliding_window`."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.moe import MoECausalLM, moe_spec, moe_weights

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def config(raw: dict) -> ModelConfig:
    """config.json of a Qwen3-MoE model: `num_experts` (transformers 5 writes `num_local_experts`),
    `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob` (default false); dense layers use
    `intermediate_size`."""
    if raw.get("model_type") != "qwen3_moe":
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not qwen3_moe")
    experts_key = "num_experts" if "num_experts" in raw else "num_local_experts"
    spec = moe_spec(raw, experts_key, "moe_intermediate_size", bool(raw.get("norm_topk_prob", False)))
    layers = raw.get("num_hidden_layers")
    slide = bool(raw.get("use_sliding_window", False)) and raw.get("sliding_window") is not None
    kinds = ["sliding_attention" if slide else "full_attention"] * (layers if isinstance(layers, int) else 0)
    raw = raw | {"layer_types": kinds} | ({} if slide else {"sliding_window": None})
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig.from_hf(raw, moe=spec, qk_norm=True, qkv_bias=bias, o_bias=bias)


class Model(MoECausalLM):
    """The Qwen3-MoE decoder: q/k norms (cfg.qk_norm), SparseMoE or dense MLP per layer."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names -> Model's (attention as Qwen3's; experts stacked), sliced for tp.rank."""
    return moe_weights(raw, cfg, tp, "mlp", EXPERT_NAMES)
