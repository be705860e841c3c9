"""Qwen3-VL (model_type qwen3_vl, the dense text model): the Qwen3 text decoder (q/k RMSNorm per head, explicit
head_dim, `attention_bias` on q/k/v/o) with interleaved M-RoPE (frequency j: h when j % 3 == 1, w when
j % 3 == 2, within 3 * mrope_section[1 or 2]; t otherwise: transformers 5 always interleaves for this family,
whatever `mrope_interleaved` says) and the vision tower with learned position embeddings and deepstack
features (engine/models/vision.py): after decoder layer i < len(deepstack_visual_indexes) the i-th feature set
is added to the image tokens' hidden states. Images only (no video). Tensor parallelism: tp 1 only for now.

config.json: `text_config` nested (the hub's and transformers 5's layout; a flat one is read too);
`tie_word_embeddings` from the top level, as transformers reads it. Checkpoint names: `model.language_model.*`,
`model.visual.*`, `lm_head` (or the older `model.*` / `visual.*`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.vision import VisionLanguageLM, vl_config, vl_weights


def config(raw: dict) -> ModelConfig:
    """config.json of a Qwen3-VL model (transformers' defaults where a field is absent)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    bias = bool(text.get("attention_bias", False))
    return vl_config(raw, "qwen3_vl", theta=500000.0, section=[24, 20, 20], interleaved=True,
                     tie=bool(raw.get("tie_word_embeddings", False)),
                     defaults=dict(rms_norm_eps=1e-6, max_position_embeddings=128000, num_key_value_heads=32,
                                   head_dim=128), qkv_bias=bias, o_bias=bias, qk_norm=True)


class Model(VisionLanguageLM):
    """Qwen3-VL: the Qwen3 decoder (q/k norms) with deepstack, and the vision tower."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """Either naming -> Model's names (q_norm/k_norm included)."""
    return vl_weights(raw, cfg, tp)
