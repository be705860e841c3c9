"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): the Qwen2 decoder (q/k/v bias per `qkv_bias`, default on)
with a sparse MoE MLP on the layers `decoder_sparse_step` / `mlp_only_layers` choose: softmax router ->
top-k, renormalised only when `norm_topk_prob`, plus a shared expert scaled by
sigmoid(shared_expert_gate(x)) (engine/models/moe.py). Sliding windows as transformers' Qwen2-MoE:
`layer_types`, else every other layer below `max_window_layers` when `use_sliding_window`."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.moe import MoECausalLM, moe_spec, moe_weights

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def _layer_types(raw: dict) -> dict:
    """raw with explicit `layer_types` (Qwen2MoeConfig's default rule when absent) and `sliding_window`
    None when no layer slides (transformers stores 0 then)."""
    layers = raw.get("num_hidden_layers")
    kinds = raw.get("layer_types")
    if kinds is None and isinstance(layers, int):
        use, last = bool(raw.get("use_sliding_window", False)), raw.get("max_window_layers", 28)
        kinds = ["sliding_attention" if (i + 1) % 2 and i < last and use else "full_attention"
                 for i in range(layers)]
    if not raw.get("sliding_window") and isinstance(kinds, list) and "sliding_attention" not in kinds:
        return raw | {"layer_types": kinds, "sliding_window": None}
    return raw | {"layer_types": kinds}


def config(raw: dict) -> ModelConfig:
    """config.json of a Qwen2-MoE model: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`,
    `shared_expert_intermediate_size`, `norm_topk_prob` (default false); dense layers use
    `intermediate_size`."""
    if raw.get("model_type") != "qwen2_moe":
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not qwen2_moe")
    spec = moe_spec(raw, "num_experts", "moe_intermediate_size", bool(raw.get("norm_topk_prob", False)),
                    shared="shared_expert_intermediate_size")
    return ModelConfig.from_hf(_layer_types(raw), moe=spec, qkv_bias=bool(raw.get("qkv_bias", True)))


class Model(MoECausalLM):
    """The Qwen2-MoE decoder: SparseMoE (with its shared expert) or dense MLP per layer."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names -> Model's (attention as the Llama family; experts stacked), sliced for tp.rank."""
    return moe_weights(raw, cfg, tp, "mlp", EXPERT_NAMES)
