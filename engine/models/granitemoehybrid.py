"""IBM Granite-4.0-H (model_type granitemoehybrid: granite-4.0-h-small / -tiny / -micro), as transformers'
GraniteMoeHybridForCausalLM. Each layer is

    x = x + m * mixer(input_layernorm(x))          mixer: Mamba2 or attention, per `layer_types`
    x = x + m * (moe(h) + shared_mlp(h)),  h = post_attention_layernorm(x)

with m = `residual_multiplier`; the embedding is scaled by `embedding_multiplier` and the logits divided by
`logits_scaling`. Mamba2: engine/models/mamba2.py (d_head `mamba_d_head`, "auto" = mamba_expand * hidden /
mamba_n_heads; the gated norm's epsilon is rms_norm_eps). Attention: q/k/v/o (biases when
`attention_bias`), softmax scale `attention_multiplier` (not head_dim^-1/2), rope only when
`position_embedding_type` is "rope" (None or "nope": no positional embedding at all, as granite-4.0-h
ships). MoE (moe.SparseMoE): softmax over the top-k router logits (= softmax, top-k, renormalised), SwiGLU
experts stored stacked in the checkpoint (`block_sparse_moe.input_linear` [E, 2I, H], gate rows then up,
`output_linear` [E, H, I], `router.layer`); the shared SwiGLU MLP (`shared_mlp.input_linear` [2S, H],
`output_linear`) on every layer, alone when `num_local_experts` is 0 (dense Granite-4.0-H-Micro).

Refused by field: `hidden_act` other than silu, `position_embedding_type` other than rope / nope / null,
`mamba_d_head` * `mamba_n_heads` != mamba_expand * hidden_size, a null or malformed `time_step_limit`,
`layer_types` of the wrong length or kinds, a model without attention layers, `num_experts_per_tok` above
the experts, rope scalings the engine cannot compute (engine/models/rope_scaling.py).

Tensor parallelism: Mamba2 and attention as mamba2.py; experts and the shared MLP by intermediate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig, MoESpec
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import Checkpoint, cat_rows, cols, rows, shell_weights
from engine.models.layers import DenseMLP, ForwardContext, RMSNorm
from engine.models.mamba2 import (
    HybridAttention,
    HybridLM,
    Mamba2Mixer,
    Mamba2Spec,
    attention_layers,
    dt_limit,
    json_float,
    mixer_weights,
    need_int,
    qkv_weights,
)
from engine.models.moe import SparseMoE
from engine.models.quant import QuantTensor
from engine.models.rope import RotaryTables

LAYER_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}


@dataclass(frozen=True)
class GraniteHybridSpec:
    """ModelConfig.hybrid of a Granite-4.0-H model."""

    kinds: tuple[str, ...]  # per layer: mamba | attention
    mamba: Mamba2Spec
    shared_intermediate_size: int  # the shared SwiGLU MLP of every layer
    rope: bool  # position_embedding_type rope (else no positional embedding)
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0  # the softmax scale
    logits_scaling: float = 1.0  # logits are divided by it


class GraniteHybridLayer(nn.Module):
    """One decoder layer (module docstring); parameter names follow the checkpoint's: input_layernorm,
    mamba.* or self_attn.*, post_attention_layernorm, block_sparse_moe.* (with its shared_expert) or
    shared_mlp.*."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup) -> None:
        super().__init__()
        spec: GraniteHybridSpec = cfg.hybrid
        self.scale = spec.residual_multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mamba = self.self_attn = None
        if spec.kinds[layer_id] == "mamba":
            self.mamba = Mamba2Mixer(spec.mamba, cfg.hidden_size, layer_id, tp)
        else:
            self.self_attn = HybridAttention(cfg, layer_id, tp, rope=spec.rope, scale=spec.attention_multiplier)
        self.block_sparse_moe = SparseMoE(cfg.hidden_size, cfg.moe, tp) if cfg.moe is not None else None
        self.shared_mlp = None if cfg.moe is not None else \
            DenseMLP(cfg.hidden_size, spec.shared_intermediate_size, tp, "shared_intermediate_size")

    def forward(self, x: torch.Tensor, rotary: RotaryTables | None, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.mamba is not None:
            x = self.mamba(h, x, ctx, self.scale)
        else:
            x = self.self_attn(h, x, ctx, rotary, self.scale)
        h = self.post_attention_layernorm(x)
        mlp = self.block_sparse_moe if self.block_sparse_moe is not None else self.shared_mlp
        if self.scale == 1.0:
            return mlp(h, residual=x)
        return x + mlp(h, residual=torch.zeros_like(x)) * self.scale  # residual + (moe + shared) * m


class Model(HybridLM):
    """The Granite-4.0-H decoder (mamba2.HybridLM with Granite's multipliers)."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        spec: GraniteHybridSpec = cfg.hybrid
        tp.split(cfg.num_heads, "num_attention_heads")  # heads first: the error names the first misfit
        tp.kv_heads(cfg.num_kv_heads)
        tp.split(spec.shared_intermediate_size, "shared_intermediate_size")
        if cfg.moe is not None:
            tp.split(cfg.moe.intermediate_size, "intermediate_size")
        super().__init__(cfg, max_pos, tp, [GraniteHybridLayer(cfg, i, tp) for i in range(cfg.num_layers)],
                         rope=spec.rope, embedding_multiplier=spec.embedding_multiplier,
                         logits_scaling=spec.logits_scaling)


def _number(raw: dict, key: str, default: float, nonzero: bool = False) -> float:
    v = json_float(raw.get(key, default))
    if v is None or v != v or (nonzero and v == 0):
        raise ValueError(f"config.json field {key!r} must be a{' nonzero' if nonzero else ''} number, got "
                         f"{raw.get(key)!r}")
    return v


def _kinds(raw: dict, layers: int) -> tuple[str, ...]:
    """`layer_types` (transformers' default: every layer Mamba2), legacy names mamba / attention too."""
    kinds = raw.get("layer_types")
    if kinds is None:
        return ("mamba",) * layers
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in LAYER_KINDS for k in kinds):
        raise ValueError(f"config.json field 'layer_types' must list {layers} layers of {sorted(LAYER_KINDS)}, "
                         f"got {kinds!r}")
    return tuple(LAYER_KINDS[k] for k in kinds)


def _mamba(raw: dict, hidden: int, eps: float) -> Mamba2Spec:
    heads, groups = need_int(raw, "mamba_n_heads", 128), need_int(raw, "mamba_n_groups", 1)
    expand = json_float(raw.get("mamba_expand", 2))
    if expand is None or expand <= 0:
        raise ValueError(f"config.json field 'mamba_expand' must be a positive number, got {raw.get('mamba_expand')!r}")
    inner = int(expand * hidden)
    d_head = raw.get("mamba_d_head", "auto")
    d_head = inner // heads if d_head == "auto" else need_int(raw, "mamba_d_head")
    if d_head * heads != inner:
        raise ValueError(f"config.json field 'mamba_d_head' ({d_head}) times mamba_n_heads ({heads}) must equal "
                         f"mamba_expand * hidden_size ({inner})")
    if heads % groups:
        raise ValueError(f"config.json field 'mamba_n_groups' ({groups}) must divide mamba_n_heads ({heads})")
    return Mamba2Spec(num_heads=heads, head_dim=d_head, n_groups=groups, d_state=need_int(raw, "mamba_d_state", 256),
                      conv_kernel=need_int(raw, "mamba_d_conv", 4), chunk_size=need_int(raw, "mamba_chunk_size", 256),
                      conv_bias=bool(raw.get("mamba_conv_bias", True)),
                      proj_bias=bool(raw.get("mamba_proj_bias", False)), norm_eps=eps,
                      dt_limit=dt_limit(raw, "time_step_limit", raw.get("time_step_limit", [0.0, "inf"])),
                      fields=("mamba_n_heads", "mamba_n_groups"))


def config(raw: dict) -> ModelConfig:
    """config.json of a Granite-4.0-H model (module docstring)."""
    if raw.get("model_type") != "granitemoehybrid":
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not granitemoehybrid")
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json field 'hidden_act' ({raw['hidden_act']!r}) is not supported (silu only)")
    pos = raw.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise ValueError(f"config.json field 'position_embedding_type' ({pos!r}) is not supported (rope, nope, null)")
    layers, hidden = need_int(raw, "num_hidden_layers"), need_int(raw, "hidden_size")
    kinds = _kinds(raw, layers)
    eps = _number(raw, "rms_norm_eps", 1e-6)
    experts = need_int(raw, "num_local_experts", 8, minimum=0)
    moe = None
    if experts:
        top_k = need_int(raw, "num_experts_per_tok", 2)
        if top_k > experts:
            raise ValueError(f"config.json field 'num_experts_per_tok' ({top_k}) exceeds num_local_experts ({experts})")
        moe = MoESpec(num_experts=experts, top_k=top_k, intermediate_size=need_int(raw, "intermediate_size"),
                      norm_topk_prob=True, shared_intermediate_size=need_int(raw, "shared_intermediate_size", 1024),
                      sparse_layers=(True,) * layers, shared_gate=False)
    spec = GraniteHybridSpec(
        kinds=kinds, mamba=_mamba(raw, hidden, eps),
        shared_intermediate_size=need_int(raw, "shared_intermediate_size", 1024), rope=pos == "rope",
        embedding_multiplier=_number(raw, "embedding_multiplier", 1.0),
        residual_multiplier=_number(raw, "residual_multiplier", 1.0),
        attention_multiplier=_number(raw, "attention_multiplier", 1.0),
        logits_scaling=_number(raw, "logits_scaling", 1.0, nonzero=True))
    drop = {"layer_types"} | (set() if spec.rope else {"rope_scaling", "rope_parameters"})  # nope: rope unused
    shared = {k: v for k, v in raw.items() if k not in drop}
    bias = bool(raw.get("attention_bias", False))
    return ModelConfig.from_hf(shared, qkv_bias=bias, o_bias=bias, moe=moe, hybrid=spec,
                               attention_layers=attention_layers(kinds, "layer_types"))


def _gate_up(w: torch.Tensor, inter: int, first: int, count: int, dim: int) -> torch.Tensor:
    """Rows (along `dim`) [first, first+count) of the gate half and of the up half of a fused [.., 2I, ..]."""
    return torch.cat([w.narrow(dim, first, count), w.narrow(dim, inter + first, count)], dim=dim)


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, torch.Tensor]:
    """HF names -> Model's, sliced for tp.rank: the stacked experts by intermediate, the shared MLP's fused
    input_linear (gate then up) as gate_up_proj."""
    spec: GraniteHybridSpec = cfg.hybrid
    ck = Checkpoint(raw)
    out = shell_weights(ck, cfg, tp)
    s0, ns = tp.split(spec.shared_intermediate_size, "shared_intermediate_size")
    s = spec.shared_intermediate_size
    for i, kind in enumerate(spec.kinds):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[ours + f"{norm}.weight"] = ck.take(hf + f"{norm}.weight")
        if kind == "mamba":
            out |= mixer_weights(ck, hf + "mamba.", ours + "mamba.", spec.mamba, tp)
        else:
            out |= qkv_weights(ck, cfg, hf + "self_attn.", ours + "self_attn.", tp)
        shared_in = ck.take(hf + "shared_mlp.input_linear.weight")
        mlp = ours + ("block_sparse_moe.shared_expert." if cfg.moe is not None else "shared_mlp.")
        out[mlp + "gate_up_proj.weight"] = cat_rows([rows(shared_in, s0, ns), rows(shared_in, s + s0, ns)])
        out[mlp + "down_proj.weight"] = cols(ck.take(hf + "shared_mlp.output_linear.weight"), s0, ns)
        if cfg.moe is not None:
            m, inter = hf + "block_sparse_moe.", cfg.moe.intermediate_size
            i0, ni = tp.split(inter, "intermediate_size")
            w13, w2 = ck.take(m + "input_linear.weight"), ck.take(m + "output_linear.weight")
            if isinstance(w13, QuantTensor) or isinstance(w2, QuantTensor):
                raise ValueError(f"weights {m}input_linear/output_linear: quantized stacked experts are not "
                                 "supported yet")
            out[ours + "block_sparse_moe.gate.weight"] = ck.take(m + "router.layer.weight")
            out[ours + "block_sparse_moe.w13"] = _gate_up(w13, inter, i0, ni, 1)
            out[ours + "block_sparse_moe.w2"] = w2.narrow(2, i0, ni)
    ck.done()
    return out
