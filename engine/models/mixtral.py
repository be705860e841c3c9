"""Mixtral: the Mistral decoder (no biases, `sliding_window` on every layer when set) with a sparse MoE
MLP on every layer: softmax router -> top-k (2) -> renormalised, experts w1 (gate), w3 (up), w2 (down)
under `block_sparse_moe` (engine/models/moe.py)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.moe import MoECausalLM, moe_spec, moe_weights

EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down


def config(raw: dict) -> ModelConfig:
    """config.json of a Mixtral model: `num_local_experts`, `num_experts_per_tok`, `intermediate_size`
    (per expert); every layer sparse."""
    if raw.get("model_type") != "mixtral":
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not mixtral")
    experts_key = "num_local_experts" if "num_local_experts" in raw else "num_experts"
    spec = moe_spec(raw | {"decoder_sparse_step": 1, "mlp_only_layers": []}, experts_key, "intermediate_size",
                    norm_topk_prob=True)
    return ModelConfig.from_hf(raw, moe=spec)


class Model(MoECausalLM):
    """The Mixtral decoder: a SparseMoE block on every layer."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names -> Model's (attention as the Llama family; experts stacked), sliced for tp.rank."""
    return moe_weights(raw, cfg, tp, "block_sparse_moe", EXPERT_NAMES)
