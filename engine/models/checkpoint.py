"""HF checkpoint names -> the shared layers' parameter names, each tensor sliced for one TP rank.

A family's `weights(raw, cfg, tp)` takes what it needs through a `Checkpoint` (which remembers every
name taken), adds the shared pieces below, and ends with `Checkpoint.done()`: a weight the model needs
but the checkpoint lacks, or one the checkpoint has but no parameter takes, is a ValueError naming it.

Slicing (layers.py's rule): column-parallel weights [out, in] keep this rank's rows (q/k/v by head,
gate/up by intermediate), row-parallel ones its columns (o, down); a row-parallel bias goes to rank 0
only; norms, the embedding and (rank 0's) LM head are whole.

A quantized weight (engine/models/quant.py's QuantTensor, from a checkpoint with a quantization_config)
goes through the same helpers: `rows`, `cols`, `cat_rows`, `stack_experts` and `permute_rows` act on its
low-bit values and its scales together.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.config import ModelConfig
from engine.distributed.tp import TPGroup
from engine.models.quant import QuantTensor

Weight = torch.Tensor | QuantTensor


class Checkpoint:
    """The checkpoint's tensors by HF name; `take` marks a name used, `done` refuses the unused rest."""

    def __init__(self, raw: Mapping[str, torch.Tensor]) -> None:
        self.raw = raw
        self.taken: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        """The tensor named `name`; ValueError naming it when the checkpoint lacks it."""
        if name not in self.raw:
            raise ValueError(f"weight {name} is missing")
        self.taken.add(name)
        return self.raw[name]

    def skip(self, name: str) -> None:
        """Mark `name` used without reading it (a weight this rank does not hold), if present."""
        if name in self.raw:
            self.taken.add(name)

    def done(self) -> None:
        """ValueError naming (up to 5) weights nothing took."""
        extra = sorted(n for n in set(self.raw) - self.taken if "rotary_emb" not in n)  # buffers, not weights
        if extra:
            raise ValueError(f"unexpected weights {extra[:5]}")


def rows(w: Weight, first: int, count: int, unit: int = 1) -> Weight:
    """w's rows [first*unit, (first+count)*unit) (a column-parallel share; 1-D biases too)."""
    if isinstance(w, QuantTensor):
        return w.rows(first * unit, (first + count) * unit)
    return w[first * unit : (first + count) * unit]


def cols(w: Weight, first: int, count: int, unit: int = 1) -> Weight:
    """w's columns [first*unit, (first+count)*unit) (a row-parallel share)."""
    if isinstance(w, QuantTensor):
        return w.cols_slice(first * unit, (first + count) * unit)
    return w[:, first * unit : (first + count) * unit]


def cat_rows(parts: list[Weight]) -> Weight:
    """Weights [out_i, in] (or biases) fused row-wise: q/k/v into qkv_proj, gate/up into gate_up_proj."""
    if any(isinstance(p, QuantTensor) for p in parts):
        if not all(isinstance(p, QuantTensor) for p in parts):
            raise ValueError("cannot fuse a quantized weight with an unquantized one")
        return QuantTensor.cat(parts)
    return torch.cat(parts)


def stack_experts(parts: list[Weight]) -> Weight:
    """Per-expert weights [out, in] -> [E, out, in]."""
    if any(isinstance(p, QuantTensor) for p in parts):
        if not all(isinstance(p, QuantTensor) for p in parts):
            raise ValueError("cannot stack quantized and unquantized expert weights")
        return QuantTensor.stack(parts)
    return torch.stack(parts)


def permute_rows(w: Weight, index: torch.Tensor) -> Weight:
    """w's rows [out, in] in the order `index` (int64 [out])."""
    return w.permute_rows(index) if isinstance(w, QuantTensor) else w.index_select(0, index)


def shell_weights(ck: Checkpoint, cfg: ModelConfig, tp: TPGroup, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Embedding, final norm and (rank 0, untied) LM head. A tied checkpoint's stray lm_head is ignored."""
    out = {"embed_tokens.weight": ck.take(prefix + "embed_tokens.weight"),
           "norm.weight": ck.take(prefix + "norm.weight")}
    if not cfg.tie_embeddings and tp.driver:
        out["lm_head.weight"] = ck.take("lm_head.weight")
    else:
        ck.skip("lm_head.weight")
    return out


def attention_weights(ck: Checkpoint, cfg: ModelConfig, layer: int, tp: TPGroup,
                      prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Layer `layer`'s self_attn (q/k/v fused into qkv_proj, this rank's heads; o_proj's columns; q/k norms)
    and its two RMSNorms."""
    a, p, d = f"{prefix}layers.{layer}.self_attn.", f"layers.{layer}.", cfg.head_dim
    q0, nq = tp.split(cfg.num_heads, "num_attention_heads")
    k0, nk = tp.kv_heads(cfg.num_kv_heads)
    out = {p + "input_layernorm.weight": ck.take(f"{prefix}layers.{layer}.input_layernorm.weight"),
           p + "post_attention_layernorm.weight": ck.take(f"{prefix}layers.{layer}.post_attention_layernorm.weight")}
    kinds = ["weight", "bias"] if cfg.qkv_bias else ["weight"]
    for kind in kinds:
        out[p + f"self_attn.qkv_proj.{kind}"] = cat_rows([
            rows(ck.take(a + f"q_proj.{kind}"), q0, nq, d), rows(ck.take(a + f"k_proj.{kind}"), k0, nk, d),
            rows(ck.take(a + f"v_proj.{kind}"), k0, nk, d)])
    out[p + "self_attn.o_proj.weight"] = cols(ck.take(a + "o_proj.weight"), q0, nq, d)
    if cfg.o_bias:
        if tp.driver:
            out[p + "self_attn.o_proj.bias"] = ck.take(a + "o_proj.bias")
        else:
            ck.skip(a + "o_proj.bias")
    if cfg.qk_norm:
        out[p + "self_attn.q_norm.weight"] = ck.take(a + "q_norm.weight")
        out[p + "self_attn.k_norm.weight"] = ck.take(a + "k_norm.weight")
    return out


def dense_mlp_weights(ck: Checkpoint, hf: str, ours: str, intermediate: int, tp: TPGroup,
                      field: str = "intermediate_size") -> dict[str, torch.Tensor]:
    """A SwiGLU block at HF prefix `hf` (e.g. 'model.layers.0.mlp.') as layers.DenseMLP at `ours`:
    gate/up rows fused into gate_up_proj, down_proj's columns, this rank's share of `intermediate`."""
    i0, n = tp.split(intermediate, field)
    return {ours + "gate_up_proj.weight": cat_rows([rows(ck.take(hf + "gate_proj.weight"), i0, n),
                                                     rows(ck.take(hf + "up_proj.weight"), i0, n)]),
            ours + "down_proj.weight": cols(ck.take(hf + "down_proj.weight"), i0, n)}


def dense_weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup) -> dict[str, torch.Tensor]:
    """A dense family's whole checkpoint (layers.CausalLM with dense_mlp), sliced for tp.rank."""
    ck = Checkpoint(raw)
    out = shell_weights(ck, cfg, tp)
    for i in range(cfg.num_layers):
        out |= attention_weights(ck, cfg, i, tp)
        out |= dense_mlp_weights(ck, f"model.layers.{i}.mlp.", f"layers.{i}.mlp.", cfg.intermediate_size, tp)
    ck.done()
    return out
