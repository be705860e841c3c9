"""Which `rope_scaling` of a config.json this engine computes exactly (pure Python, no torch: ModelConfig
parsing in engine/config.py checks it without loading the model code; engine/models/rope.py computes it).
Anything else is a ValueError naming the field, never an approximation.
"""

from __future__ import annotations

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_KEYS = {  # the keys each type reads; any other key is refused (rope_type/type/rope_theta always allowed)
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor",
             "mscale", "mscale_all_dim", "truncate"},
}


def rope_type(scaling: dict | None) -> str:
    """The scaling's type ('default' for none), ValueError naming 'rope_scaling.rope_type' if unsupported."""
    if not scaling:
        return "default"
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        why = (": its frequencies change with the length of each forward, which a paged cache cannot reproduce"
               if kind == "dynamic" else "")
        raise ValueError(f"config.json field 'rope_scaling.rope_type' ({kind!r}) is not supported{why}; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    return kind


def _number(scaling: dict, key: str, default: float | None = None) -> float:
    v = scaling.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ValueError(f"config.json field 'rope_scaling.{key}' must be a positive number, got {v!r}")
    return float(v)


def check_rope(scaling: dict | None) -> None:
    """ValueError naming the first field of `scaling` this engine cannot honour exactly."""
    kind = rope_type(scaling)
    if not scaling:
        return
    prf = scaling.get("partial_rotary_factor", 1.0)
    if prf != 1.0:
        raise ValueError(f"config.json field 'partial_rotary_factor' ({prf!r}) is not supported (only 1.0)")
    extra = set(scaling) - _KEYS[kind] - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    extra = {k for k in extra if scaling[k] is not None}
    if extra:
        raise ValueError(f"config.json field 'rope_scaling.{sorted(extra)[0]}' is not supported with "
                         f"rope_type {kind!r}")
    if kind in ("linear", "llama3", "yarn"):
        _number(scaling, "factor")
    if kind == "yarn":
        _number(scaling, "original_max_position_embeddings")
        for key in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim"):
            if scaling.get(key) is not None:
                _number(scaling, key)
