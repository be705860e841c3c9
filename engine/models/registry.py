"""model_type -> the family module that runs it. Adding a family = one module under engine/models/ plus
one line here (and one oracle test).

A family module defines:
  config(raw: dict) -> ModelConfig   parse and validate config.json (ModelConfig.from_hf does the shared
                                     part); a field it cannot honour exactly -> ValueError naming it
  Model(cfg, max_pos, tp)            an nn.Module: forward(input_ids, positions, ctx) -> hidden [T, H],
                                     logits(hidden) -> fp32 [N, V] on tp.driver only, local_kv_heads
  weights(raw, cfg, tp)              HF checkpoint names -> Model's parameter names, sliced for tp.rank;
                                     missing/unexpected weights -> ValueError naming them
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "qwen3",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    # hybrid recurrent families (engine/recurrent/: a state slot per request beside the attention layers' KV)
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5",
    "nemotron_h": "nemotron_h",
    "granitemoehybrid": "granitemoehybrid",
    # vision-language families (engine/models/vision.py: the towers; M-RoPE positions in mrope.py)
    "qwen2_5_vl": "qwen2_5_vl",
    "qwen3_vl": "qwen3_vl",
}


def family(model_type: str) -> ModuleType:
    """The family module running `model_type`; ValueError naming it when no family does."""
    name = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if name is None:
        raise ValueError(f"config.json field 'model_type' ({model_type!r}) is not a model family this engine "
                         f"runs; supported: {', '.join(sorted(FAMILIES))}")
    return importlib.import_module(f"engine.models.{name}")
