"""Qwen3.5 (model_type qwen3_5_text, qwen3_5_moe_text, and the multimodal wrappers qwen3_5, qwen3_5_moe):
the Qwen3-Next hybrid decoder (engine/models/qwen3_next.py: Gated DeltaNet and gated-attention layers,
zero-centred norms, partial rope), which this module reuses whole. What differs from Qwen3-Next, all of
it in config.json and the checkpoint, none in the math:

- the Gated DeltaNet's input projections ship apart: in_proj_qkv (rows q|k|v, every head in order),
  in_proj_z, in_proj_b, in_proj_a, instead of Qwen3-Next's per-key-head groups; `weights` slices each for
  the rank and fuses them into the same in_proj_qkvz (q|k|v|z) and in_proj_ba (b|a) as Qwen3-Next's;
- rope is mrope (`mrope_section` over three position axes): a text prompt's token has the same position
  on every axis, where mrope is exactly the plain (partial) rope; images and video are not served;
- Qwen3.5 (dense) has a SwiGLU MLP on every layer; Qwen3.5-MoE a SparseMoE on every layer (there is no
  `mlp_only_layers` / `decoder_sparse_step`) whose router always renormalises its top-k (transformers'
  Qwen3_5MoeTopKRouter), plus the gated shared expert. Its checkpoints ship each layer's experts fused
  (`experts.gate_up_proj` [E, 2I, H], gate rows then up rows, and `experts.down_proj` [E, H, I]); per-expert
  names (`experts.N.gate_proj.weight`, as transformers' save_pretrained writes) load too.

The multimodal wrappers (qwen3_5, qwen3_5_moe: Qwen3_5(Moe)ForConditionalGeneration) are served as their
language model: config.json's `text_config` is the model (the wrapper's `tie_word_embeddings` decides the
tie, as in transformers), the decoder weights are read under `model.language_model.`, and the vision tower
(`model.visual.*`) is not loaded: its weights are skipped with a log line, never refused. Multi-token
prediction weights (`mtp.*`) are skipped likewise. Everything qwen3_next.py refuses is refused here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models import qwen3_next
from engine.models.checkpoint import Checkpoint, Weight, cat_rows, rows
from engine.models.moe import moe_spec
from engine.models.quant import QuantTensor
from engine.models.qwen3_next import GDNSpec, conv_rows, heads, hybrid_config, hybrid_weights

TEXT_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text",
              "qwen3_5_text": "qwen3_5_text", "qwen3_5_moe_text": "qwen3_5_moe_text"}
WRAPPER_PREFIX = "model.language_model."  # a multimodal checkpoint's decoder


def _text_config(raw: dict) -> dict:
    """The language model's config: `raw` itself for the *_text types, else its `text_config` with the
    wrapper's tie_word_embeddings (and its bos/eos ids where the text config has none)."""
    mtype = raw.get("model_type")
    if mtype not in TEXT_TYPES:
        raise ValueError(f"config.json field 'model_type' ({mtype!r}) is not a Qwen3.5 model")
    if mtype == TEXT_TYPES[mtype]:
        return raw
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"config.json field 'text_config' must be an object for model_type {mtype!r}, got {text!r}")
    if text.get("model_type", TEXT_TYPES[mtype]) != TEXT_TYPES[mtype]:
        raise ValueError(f"config.json field 'text_config.model_type' ({text['model_type']!r}) is not "
                         f"{TEXT_TYPES[mtype]!r}")
    out = dict(text)
    if raw.get("tie_word_embeddings") is not None:
        out["tie_word_embeddings"] = raw["tie_word_embeddings"]
    for key in ("bos_token_id", "eos_token_id"):
        if out.get(key) is None and raw.get(key) is not None:
            out[key] = raw[key]
    return out


def config(raw: dict) -> ModelConfig:
    """config.json of a Qwen3.5 / Qwen3.5-MoE model (text, or a multimodal wrapper: its text_config)."""
    text = _text_config(raw)
    mtype = raw["model_type"]
    moe = None
    if TEXT_TYPES[mtype] == "qwen3_5_moe_text":
        # every layer sparse, top-k always renormalised; the Qwen3-Next sparsity fields do not exist here
        routed = {k: v for k, v in text.items() if k not in ("decoder_sparse_step", "mlp_only_layers")}
        moe = moe_spec(routed, "num_experts", "moe_intermediate_size", True, shared="shared_expert_intermediate_size")
        moe = dataclasses.replace(moe, sparse_layers=(True,) * len(moe.sparse_layers))
        # no dense MLP anywhere: intermediate_size (absent from the config) is never used
        text = text | {"intermediate_size": text.get("intermediate_size") or moe.intermediate_size}
    return hybrid_config(text, moe, mtype)


class Model(qwen3_next.Model):
    """The Qwen3-Next hybrid decoder (qwen3_next.Model): identical layers and parameter names."""


def split_in_proj(ck: Checkpoint, a: str, spec: GDNSpec, tp: TPGroup) -> tuple[Weight, Weight, torch.Tensor]:
    """Qwen3.5's in_proj_qkv [2 H_k d_k + H_v d_v, H], in_proj_z [H_v d_v, H], in_proj_b / in_proj_a [H_v, H]
    -> (in_proj_qkvz rows q|k|v|z and in_proj_ba rows b|a of this rank's heads, its conv rows)."""
    k0, nk, v0, nv = heads(spec, tp)
    dk, dv, key = spec.k_head_dim, spec.v_head_dim, spec.num_k_heads * spec.k_head_dim
    qkv = ck.take(a + "in_proj_qkv.weight")
    qkvz = cat_rows([rows(qkv, k0, nk, dk), rows(qkv, key + k0 * dk, nk * dk), rows(qkv, 2 * key + v0 * dv, nv * dv),
                     rows(ck.take(a + "in_proj_z.weight"), v0, nv, dv)])
    ba = cat_rows([rows(ck.take(a + "in_proj_b.weight"), v0, nv), rows(ck.take(a + "in_proj_a.weight"), v0, nv)])
    return qkvz, ba, conv_rows(ck.take(a + "conv1d.weight"), spec, tp)


def unfuse_experts(raw: Mapping[str, torch.Tensor], cfg: ModelConfig) -> Mapping[str, torch.Tensor]:
    """raw with each layer's fused `experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] given as
    per-expert views `experts.N.{gate,up,down}_proj.weight` (what moe.block_weights reads); raw itself when
    the checkpoint has none."""
    fused = [n for n in raw if n.endswith(".experts.gate_up_proj") or n.endswith(".experts.down_proj")]
    if not fused or cfg.moe is None:
        return raw
    out = {n: t for n, t in raw.items() if n not in fused}
    e_count, inter, hidden = cfg.moe.num_experts, cfg.moe.intermediate_size, cfg.hidden_size
    for name in fused:
        t = raw[name]
        base = name.rsplit(".", 1)[0] + "."  # …mlp.experts.
        gate_up = name.endswith("gate_up_proj")
        want = (e_count, 2 * inter, hidden) if gate_up else (e_count, hidden, inter)
        if isinstance(t, QuantTensor) or tuple(t.shape) != want:
            what = "quantized" if isinstance(t, QuantTensor) else f"of shape {tuple(t.shape)}"
            raise ValueError(f"weight {name} is {what}; this engine reads fused experts as full-precision {want}")
        for e in range(e_count):
            if gate_up:
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = t[e, :inter], t[e, inter:]
            else:
                out[f"{base}{e}.down_proj.weight"] = t[e]
    return out


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, Weight]:
    """HF names -> Model's, sliced for tp.rank: the decoder under `model.` (text checkpoints) or
    `model.language_model.` (multimodal ones, whose `model.visual.*` is skipped), the split in_proj_* fused,
    fused experts taken apart and stacked again, `mtp.*` skipped."""
    prefix = WRAPPER_PREFIX if any(n.startswith(WRAPPER_PREFIX) for n in raw) else "model."
    return hybrid_weights(unfuse_experts(raw, cfg), cfg, tp, split_in_proj, prefix)
