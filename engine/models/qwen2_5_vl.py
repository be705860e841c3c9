"""Qwen2.5-VL (model_type qwen2_5_vl): the Qwen2 text decoder (q/k/v biases, head_dim = hidden / heads) with
M-RoPE over three position rows in blocks (mrope_section: t, then h, then w frequencies) and the windowed
vision tower (engine/models/vision.py). Images only (no video). Tensor parallelism: tp 1 only for now.

config.json: the hub's layout (text fields at the top level, `rope_scaling: {type: mrope, mrope_section}`) or
transformers 5's (`text_config`, `rope_parameters`); tied embeddings when the top level or text_config says so.
Checkpoints: the hub's names (`model.layers.*`, `model.embed_tokens`, `visual.*`, `lm_head`) or transformers
5's (`model.language_model.*`, `model.visual.*`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.vision import VisionLanguageLM, vl_config, vl_weights


def config(raw: dict) -> ModelConfig:
    """config.json of a Qwen2.5-VL model (transformers' defaults where a field is absent)."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    heads, hidden = text.get("num_attention_heads"), text.get("hidden_size")
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(text.get("tie_word_embeddings", False))
    fields = {}
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        fields["head_dim"] = hidden // heads  # transformers ignores a head_dim field here
    return vl_config(raw, "qwen2_5_vl", theta=1000000.0, section=[16, 24, 24], interleaved=False, tie=tie,
                     defaults=dict(rms_norm_eps=1e-5, max_position_embeddings=32768, num_key_value_heads=8),
                     qkv_bias=True, o_bias=False, **fields)


class Model(VisionLanguageLM):
    """Qwen2.5-VL: the dense decoder (qkv biases) and the windowed vision tower."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__(cfg, max_pos, tp)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """Either naming (hub or transformers 5) -> Model's names."""
    return vl_weights(raw, cfg, tp)
