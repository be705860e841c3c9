"""Qwen3-Next (model_type qwen3_next): a hybrid of Gated DeltaNet layers (linear attention with a recurrent
state, engine/recurrent/) and gated full-attention layers, as transformers' Qwen3NextForCausalLM.

Layers. `layer_types` (else every `full_attention_interval`-th layer, default 4) names each layer
"linear_attention" or "full_attention"; only the full-attention layers have a KV cache
(ModelConfig.attention_layers, kv_index), each linear layer keeps a per-request state slot instead
(`Model.state_spec`: a conv state and a recurrent state per layer). Every layer is
    h = x + mixer(norm1(x));  out = h + mlp(norm2(h))
with the MLP a SparseMoE (routed experts + a shared expert scaled by sigmoid(shared_expert_gate(x)),
engine/models/moe.py) on the layers `decoder_sparse_step` / `mlp_only_layers` choose, else dense SwiGLU.

Norms. Every RMSNorm of the decoder (input/post-attention, the final norm, attention's per-head q/k
norms) is zero-centred: the checkpoint stores w and the norm computes x * rsqrt(mean(x^2) + eps) * (1 + w)
in fp32 (`OffsetRMSNorm`). The one exception is the Gated DeltaNet's output norm (`GatedRMSNorm`):
rmsnorm(o) * w * silu(z), w as stored.

Gated attention (`GatedAttention`, per token, this rank's Hq query / Hkv KV heads of dim D):
    q_proj(x) -> per head [q (D) | gate (D)];  k = k_proj(x), v = v_proj(x)
    q, k <- OffsetRMSNorm per head; rope on the first R = head_dim * partial_rotary_factor dims only
    (rotate-half within those R dims; the other D - R dims pass through); k, v -> the paged KV pool
    o = softmax(q k^T / sqrt(D)) v  (causal, over the pool);  out = o_proj(o * sigmoid(gate))
The engine's shared Attention (and the native rope_store) rotate whole heads, so this layer rotates in
torch and writes the pool itself. Partial rope's tables come from `PartialRotary` (the same formulas as
engine/models/rope.py, over R dims); with a text-only prompt Qwen3.5's mrope (three position axes) is this
same rope, every axis having the token's position.

Gated DeltaNet (`GatedDeltaNet`, per token, this rank's H_k key heads of d_k and H_v = r H_k value heads
of d_v):
    in_proj_qkvz(x) -> q [H_k d_k] | k [H_k d_k] | v [H_v d_v] | z [H_v d_v];  in_proj_ba(x) -> b | a [H_v]
    q|k|v <- silu(causal depthwise conv1d, kernel K, over the sequence)   (state: the last K-1 inputs)
    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)             (gated_delta.gates)
    o = the gated delta rule over (l2norm q, l2norm k, v, g, beta)       (state S [H_v, d_k, d_v] fp32)
    out = out_proj(rmsnorm(o) * w * silu(z))
Qwen3-Next's checkpoint groups in_proj_qkvz / in_proj_ba per key head ([q k v z] and [b a] of each key
head's group of r value heads); `weights` re-orders the rows into the layout above (Qwen3.5 ships q|k|v,
z, b, a apart: engine/models/qwen3_5.py maps those). Two GEMMs, not one: a quantized checkpoint may ship
the small b/a projection unquantized beside a quantized q/k/v/z one.

Tensor parallelism: attention by head as the shared layers (o row-parallel); the Gated DeltaNet by key
head (`linear_num_key_heads` / tp each, with their r value heads): in_proj_*'s rows, the conv channels of
this rank's q, k and v heads, A_log / dt_bias of its value heads, out_proj row-parallel (rank 0 adds the
residual, one all-reduce); the gated norm's w [d_v] is replicated. MoE as engine/models/moe.py.

Refused by field (ValueError): a `hidden_act` other than silu (it is also the conv's activation),
`attention_bias`, a `linear_conv_kernel_dim` below 2, `linear_num_value_heads` not a multiple of
`linear_num_key_heads`, a `partial_rotary_factor` leaving an odd or empty rotary part, malformed
`layer_types` or none with full attention, and what ModelConfig / moe_spec refuse. Multi-token-prediction
weights (`mtp.*`, `mtp_num_hidden_layers`) are skipped at load with a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig, MoESpec
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import Checkpoint, Weight, cat_rows, cols, dense_mlp_weights, rows, shell_weights
from engine.models.layers import CausalLM, ForwardContext, RotaryTables, embedding, linear, row_parallel
from engine.models.moe import block_weights, moe_mlp, moe_spec
from engine.models.rope import rope_params
from engine.recurrent.gated_delta import gates
from engine.recurrent.state_pool import StatePart, StateSpec

log = logging.getLogger(__name__)

EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
LINEAR, FULL = "linear_attention", "full_attention"
_ROPE_EXTRAS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")  # read here, not by ModelConfig


@dataclass(frozen=True)
class GDNSpec:
    """The Gated DeltaNet layers' sizes (ModelConfig.hybrid of the Qwen3-Next / Qwen3.5 families), whole
    model (a TP rank holds num_k_heads / tp key heads and their value heads)."""

    num_k_heads: int  # linear_num_key_heads
    num_v_heads: int  # linear_num_value_heads, a multiple of num_k_heads
    k_head_dim: int  # linear_key_head_dim
    v_head_dim: int  # linear_value_head_dim
    conv_kernel: int  # linear_conv_kernel_dim
    rotary_dim: int  # the attention layers' rope dims per head: head_dim * partial_rotary_factor
    linear_layers: tuple[int, ...]  # the Gated DeltaNet layers (the others are full attention)
    q_gate = True  # the attention layers' q_proj rows are [q | gate] per head (LoRA slices them so)

    @property
    def group(self) -> int:
        """Value heads per key head (r)."""
        return self.num_v_heads // self.num_k_heads


def _int(raw: dict, key: str, default: object = None, minimum: int = 1) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"config.json field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _layer_types(raw: dict, layers: int) -> list[str]:
    """Each layer's kind, as transformers reads it: `layer_types`, else full attention every
    `full_attention_interval`-th layer (default 4)."""
    kinds = raw.get("layer_types")
    if kinds is None:
        every = _int(raw, "full_attention_interval", 4)
        kinds = [LINEAR if (i + 1) % every else FULL for i in range(layers)]
    if not isinstance(kinds, list) or len(kinds) != layers or any(k not in (LINEAR, FULL) for k in kinds):
        raise ValueError(f"config.json field 'layer_types' must list {layers} of {(LINEAR, FULL)}, got {kinds!r}")
    if FULL not in kinds:
        raise ValueError("config.json field 'layer_types' has no full_attention layer (this engine needs at least "
                         "one attention layer beside the Gated DeltaNet layers)")
    return kinds


def _partial_rotary_factor(raw: dict) -> float:
    """partial_rotary_factor from the top level, rope_parameters or rope_scaling (transformers' default
    for these families: 0.25); two different values are refused (which one transformers reads is not ours
    to guess)."""
    found = [src["partial_rotary_factor"] for src in (raw, raw.get("rope_parameters"), raw.get("rope_scaling"))
             if isinstance(src, dict) and src.get("partial_rotary_factor") is not None]
    if any(v != found[0] for v in found):
        raise ValueError(f"config.json field 'partial_rotary_factor' has different values {found} (top level, "
                         "rope_parameters, rope_scaling)")
    v = found[0] if found else 0.25
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"config.json field 'partial_rotary_factor' must be in (0, 1], got {v!r}")
    return float(v)


def _without_rope_extras(raw: dict) -> dict:
    """raw with the rope keys this module reads itself (partial rotary, mrope) removed from its rope dicts,
    so ModelConfig's rope check sees only the scaling it computes."""
    out = {k: v for k, v in raw.items() if k != "partial_rotary_factor"}
    for key in ("rope_parameters", "rope_scaling"):
        if isinstance(raw.get(key), dict):
            out[key] = {k: v for k, v in raw[key].items() if k not in _ROPE_EXTRAS}
    return out


def hybrid_config(raw: dict, moe: MoESpec | None, model_type: str) -> ModelConfig:
    """The ModelConfig of a Qwen3-Next / Qwen3.5 text config `raw` (the shared fields, the attention
    layers, GDNSpec as `hybrid`), with `moe` as the MLP spec; `model_type` is the one ModelConfig keeps
    (the family's registry key)."""
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"config.json field 'hidden_act' ({raw['hidden_act']!r}) is not supported (silu only: it "
                         "is the MLP's and the Gated DeltaNet conv's activation)")
    if raw.get("attention_bias"):
        raise ValueError("config.json field 'attention_bias' (true) is not supported for this family")
    layers = _int(raw, "num_hidden_layers")
    kinds = _layer_types(raw, layers)
    hk, hv = _int(raw, "linear_num_key_heads", 16), _int(raw, "linear_num_value_heads", 32)
    if hv % hk:
        raise ValueError(f"config.json field 'linear_num_value_heads' ({hv}) must be a multiple of "
                         f"linear_num_key_heads ({hk})")
    kernel = _int(raw, "linear_conv_kernel_dim", 4, minimum=2)
    head_dim = _int(raw, "head_dim", 256)
    prf = _partial_rotary_factor(raw)
    rotary = int(head_dim * prf)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"config.json field 'partial_rotary_factor' ({prf}) leaves {rotary} rotary dims of "
                         f"head_dim {head_dim} (an even number >= 2 is needed)")
    spec = GDNSpec(num_k_heads=hk, num_v_heads=hv, k_head_dim=_int(raw, "linear_key_head_dim", 128),
                   v_head_dim=_int(raw, "linear_value_head_dim", 128), conv_kernel=kernel, rotary_dim=rotary,
                   linear_layers=tuple(i for i, k in enumerate(kinds) if k == LINEAR))
    # transformers' attention here has no sliding window (the fields are ignored); layer kinds are ours
    shared = _without_rope_extras(raw) | {"layer_types": None, "sliding_window": None, "use_sliding_window": False,
                                         "head_dim": head_dim, "model_type": model_type}
    return ModelConfig.from_hf(shared, qk_norm=True, moe=moe, hybrid=spec,
                               attention_layers=tuple(i for i, k in enumerate(kinds) if k == FULL))


def config(raw: dict) -> ModelConfig:
    """config.json of a Qwen3-Next model: the GDN fields (linear_*), layer_types / full_attention_interval,
    partial_rotary_factor, and the Qwen2-MoE-style MoE fields (`num_experts` 0: every MLP dense)."""
    if raw.get("model_type") != "qwen3_next":
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not qwen3_next")
    moe = None
    if raw.get("num_experts", 0) != 0:
        moe = moe_spec(raw, "num_experts", "moe_intermediate_size", bool(raw.get("norm_topk_prob", True)),
                       shared="shared_expert_intermediate_size")
    return hybrid_config(raw, moe, "qwen3_next")


# ---- layers -----------------------------------------------------------------------------------------

class OffsetRMSNorm(nn.Module):
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w) in fp32, w as the checkpoint stores it
    (ones-centred weights would be w + 1; transformers' Qwen3NextRMSNorm / Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> the same shape and dtype."""
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet's output norm, per value head: rmsnorm(o) * w * silu(z) (w as stored; the norm
    in fp32, times w in the model dtype, the silu gate in fp32, as transformers' RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z [..., dim] -> [..., dim] in o's dtype."""
        y = self.weight * F.rms_norm(o.float(), self.weight.shape, None, self.eps).to(o.dtype)
        return (y.float() * F.silu(z.float())).to(o.dtype)


class PartialRotary:
    """Rope over the first `dim` dims of each head: cos/sin [T, 1, dim/2] of the step's positions, computed
    per forward from the inverse frequencies (engine/models/rope.py's rope_params over `dim`; fp32, times
    the attention factor), which stay outside the module tree so the loader's dtype cast never touches
    them. (The loader's whole-head `Model.rotary` tables are not used by this family.)"""

    def __init__(self, dim: int, theta: float, scaling: dict | None) -> None:
        with torch.device("cpu"):  # the Model is built on the meta device: these must be real
            self.inv, self.attention = rope_params(dim, theta, scaling)  # fp32 [dim/2], float

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        if self.inv.device != positions.device:
            self.inv = self.inv.to(positions.device)
        freqs = positions.float()[:, None] * self.inv  # [T, dim/2], as Rotary's outer product
        return RotaryTables((freqs.cos() * self.attention).unsqueeze(1), (freqs.sin() * self.attention).unsqueeze(1))


class GatedAttention(nn.Module):
    """Qwen3-Next's full-attention layer over the paged pool (module docstring): this rank's `hq` query
    heads with their output gates, `hkv` KV heads; parameters qkv_proj ([q|gate per head] x hq, k, v rows),
    q_norm, k_norm (zero-centred, [D]), o_proj."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        self.kv_layer = cfg.kv_index(layer_id)
        self.hq = tp.split(cfg.num_heads, "num_attention_heads")[1]
        self.hkv = tp.kv_heads(cfg.num_kv_heads)[1]
        self.d = d = cfg.head_dim
        self.rotary_dim = cfg.hybrid.rotary_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (2 * self.hq + 2 * self.hkv) * d, bias=False)
        self.o_proj = nn.Linear(self.hq * d, cfg.hidden_size, bias=False)
        self.q_norm = OffsetRMSNorm(d, cfg.rms_eps)
        self.k_norm = OffsetRMSNorm(d, cfg.rms_eps)

    def forward(self, x: torch.Tensor, rope: RotaryTables, ctx: ForwardContext,
                residual: torch.Tensor) -> torch.Tensor:
        """x (normed), residual [T, H] -> residual + o_proj(attention * sigmoid(gate)) [T, H] (summed over
        the group)."""
        t, d, r = x.shape[0], self.d, self.rotary_dim
        qkv = linear(self.qkv_proj, x)  # [T, (2Hq + 2Hkv) D]
        if ctx.lora is not None:  # each adapter's rows += x A^T B^T (q_proj's rows: [q|gate] per head, as here)
            ctx.lora.apply(self.layer_id, "qkv", x, qkv)
        q_gate = qkv[:, : 2 * self.hq * d].view(t, self.hq, 2 * d)
        k, v = qkv[:, 2 * self.hq * d :].split(self.hkv * d, dim=-1)
        q = self.q_norm(q_gate[..., :d])  # [T, Hq, D], a new tensor
        k = self.k_norm(k.reshape(t, self.hkv, d))  # [T, Hkv, D]
        q[..., :r] = rope(q[..., :r])
        k[..., :r] = rope(k[..., :r])
        ctx.pool.write(self.kv_layer, ctx.out_page, ctx.out_offset, k, v.reshape(t, self.hkv, d))
        k_pages, v_pages = ctx.pool.layer(self.kv_layer)
        o = ctx.backend.forward(q, k_pages, v_pages, ctx.meta, 0)  # [T, Hq, D]
        o = o.reshape(t, self.hq * d) * torch.sigmoid(q_gate[..., d:].reshape(t, self.hq * d))
        if ctx.lora is not None:
            return ctx.lora.row_parallel(self.o_proj, o, residual, self.tp, self.layer_id, "o")
        return row_parallel(self.o_proj, o, residual, self.tp)


class GatedDeltaNet(nn.Module):
    """A Gated DeltaNet layer (module docstring) over this rank's `hk` key / `hv` value heads. Parameters:
    in_proj_qkvz.weight [2 hk d_k + 2 hv d_v, H] (q|k|v|z), in_proj_ba.weight [2 hv, H] (b|a), conv_weight
    [C, K] (C = 2 hk d_k + hv d_v: q|k|v channels), A_log, dt_bias [hv], norm.weight [d_v], out_proj.weight
    [H, hv d_v]. Its state lives in
    ctx.state's parts f"{layer_id}.conv" [C, K-1] and f"{layer_id}.ssm" [hv, d_k, d_v] fp32."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        spec: GDNSpec = cfg.hybrid
        self.layer_id, self.tp, self.spec = layer_id, tp, spec
        self.hk = tp.split(spec.num_k_heads, "linear_num_key_heads")[1]
        self.hv = self.hk * spec.group
        self.dk, self.dv = spec.k_head_dim, spec.v_head_dim
        self.conv_dim = 2 * self.hk * self.dk + self.hv * self.dv
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, self.conv_dim + self.hv * self.dv, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.hv, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, spec.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(self.hv))
        self.dt_bias = nn.Parameter(torch.empty(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_eps)
        self.out_proj = nn.Linear(self.hv * self.dv, cfg.hidden_size, bias=False)

    def state_parts(self, tp: TPGroup | None = None) -> tuple[StatePart, StatePart]:
        """This layer's parts of a request's state on this rank (or on rank `tp`): conv [C, K-1] (the conv
        weight's dtype), recurrent [hv, d_k, d_v] fp32, each naming its rows of the whole layer's (q|k|v
        channels, value heads)."""
        spec = self.spec
        _, _, v0, nv = heads(spec, tp or self.tp)
        return (StatePart(f"{self.layer_id}.conv", (self.conv_dim, self.conv_weight.shape[1] - 1),
                          self.conv_weight.dtype, conv_runs(spec, tp or self.tp), conv_channels(spec)),
                StatePart(f"{self.layer_id}.ssm", (self.hv, self.dk, self.dv), torch.float32, ((v0, nv),),
                          spec.num_k_heads * spec.group))

    def forward(self, x: torch.Tensor, ctx: ForwardContext, residual: torch.Tensor) -> torch.Tensor:
        """x (normed), residual [T, H] (the batch's segments packed) -> residual + out_proj(...) [T, H]
        (summed over the group); updates this layer's state of every segment's slot."""
        if ctx.state is None:
            raise RuntimeError(f"layer {self.layer_id} is a Gated DeltaNet layer: the forward needs state slots "
                               "(Segment.slot)")
        t, hk, hv, dk, dv = x.shape[0], self.hk, self.hv, self.dk, self.dv
        qkv, z = linear(self.in_proj_qkvz, x).split([self.conv_dim, hv * dv], dim=-1)
        b, a = linear(self.in_proj_ba, x).split(hv, dim=-1)
        qkv = ctx.state.conv(f"{self.layer_id}.conv", qkv, self.conv_weight, None, "silu")  # [T, C]
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        g, beta = gates(a, b, self.A_log, self.dt_bias)  # fp32 [T, hv]
        o = ctx.state.gated_delta(f"{self.layer_id}.ssm", q.reshape(t, hk, dk), k.reshape(t, hk, dk),
                                  v.reshape(t, hv, dv), g, beta, use_qk_l2norm=True)  # [T, hv, dv]
        o = self.norm(o, z.reshape(t, hv, dv)).reshape(t, hv * dv)
        return row_parallel(self.out_proj, o, residual, self.tp)


class HybridLayer(nn.Module):
    """One decoder layer: `linear_attn` (GatedDeltaNet) or `self_attn` (GatedAttention), then the MLP
    block, each after its zero-centred norm, each added to the residual stream."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_eps)
        if layer_id in cfg.hybrid.linear_layers:
            self.linear_attn = GatedDeltaNet(cfg, layer_id, tp)
        else:
            self.self_attn = GatedAttention(cfg, layer_id, tp)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: RotaryTables, ctx: ForwardContext) -> torch.Tensor:
        mixer = getattr(self, "linear_attn", None)
        if mixer is not None:
            h = mixer(self.input_layernorm(x), ctx, residual=x)
        else:
            h = self.self_attn(self.input_layernorm(x), rope, ctx, residual=x)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class Model(nn.Module):
    """The hybrid decoder: embedding -> HybridLayers -> zero-centred final norm; `logits` on rank 0 only
    (as layers.CausalLM). Parameter names: embed_tokens, layers.N.{input_layernorm, post_attention_layernorm,
    linear_attn.* | self_attn.*, mlp.*}, norm, lm_head (untied, rank 0)."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        if not isinstance(cfg.hybrid, GDNSpec):
            raise ValueError(f"{cfg.model_type}: ModelConfig.hybrid is not a Gated DeltaNet spec")
        self.cfg, self.tp = cfg, tp
        tp.split(cfg.num_heads, "num_attention_heads")  # heads first: the error names the first misfit
        tp.kv_heads(cfg.num_kv_heads)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i, tp, moe_mlp(cfg, i, tp)) for i in range(cfg.num_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.rope = PartialRotary(cfg.hybrid.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        untied_head = not cfg.tie_embeddings and tp.driver
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if untied_head else None

    logits = CausalLM.logits
    lm_head_weight = CausalLM.lm_head_weight

    def _first_attention(self) -> GatedAttention:
        return self.layers[self.cfg.attention_layers[0]].self_attn

    @property
    def local_heads(self) -> int:
        """Query heads this rank computes."""
        return self._first_attention().hq

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank computes and keeps in its pool (attention layers only)."""
        return self._first_attention().hkv

    def state_spec(self, tp: TPGroup | None = None) -> StateSpec:
        """One request's recurrent state on this rank (or on rank `tp` of its group): each Gated DeltaNet
        layer's conv and recurrent state."""
        return StateSpec(tuple(p for i in self.cfg.hybrid.linear_layers for p in self.layers[i].linear_attn
                               .state_parts(tp)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final hidden states [T, H] (the same on every rank);
        ctx.state holds each segment's state slot."""
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        rope = self.rope.tables(positions)
        for layer in self.layers:
            x = layer(x, rope, ctx)
        return self.norm(x)


# ---- weights ----------------------------------------------------------------------------------------

InProj = Callable[[Checkpoint, str, GDNSpec, TPGroup], tuple[Weight, Weight, torch.Tensor]]


def heads(spec: GDNSpec, tp: TPGroup) -> tuple[int, int, int, int]:
    """(first key head, key heads, first value head, value heads) of this rank."""
    k0, nk = tp.split(spec.num_k_heads, "linear_num_key_heads")
    return k0, nk, k0 * spec.group, nk * spec.group


def conv_channels(spec: GDNSpec) -> int:
    """Channels of the whole layer's convolution: q|k|v of every head."""
    return 2 * spec.num_k_heads * spec.k_head_dim + spec.num_k_heads * spec.group * spec.v_head_dim


def conv_runs(spec: GDNSpec, tp: TPGroup) -> tuple[tuple[int, int], ...]:
    """(first, count) runs of the whole convolution's channels (q|k|v of every head) that are this rank's:
    its key heads' q and k channels, its value heads' v channels."""
    k0, nk, v0, nv = heads(spec, tp)
    dk, dv, key = spec.k_head_dim, spec.v_head_dim, spec.num_k_heads * spec.k_head_dim
    return (k0 * dk, nk * dk), (key + k0 * dk, nk * dk), (2 * key + v0 * dv, nv * dv)


def conv_rows(conv: Weight, spec: GDNSpec, tp: TPGroup) -> torch.Tensor:
    """conv1d.weight [C, 1, K] (channels q|k|v of every head) -> this rank's channels [C_rank, K]."""
    if not isinstance(conv, torch.Tensor):
        raise ValueError("a quantized Gated DeltaNet conv1d.weight is not supported (it runs in full precision)")
    w = conv.reshape(conv.shape[0], -1)
    return torch.cat([w[first : first + count] for first, count in conv_runs(spec, tp)])


def grouped_in_proj(ck: Checkpoint, a: str, spec: GDNSpec, tp: TPGroup) -> tuple[Weight, Weight, torch.Tensor]:
    """Qwen3-Next's in_proj_qkvz [H_k (2 d_k + 2 r d_v), H] and in_proj_ba [H_k 2r, H], grouped per key
    head, -> (in_proj_qkvz rows q|k|v|z and in_proj_ba rows b|a of this rank's heads, its conv rows)."""
    k0, nk, _, _ = heads(spec, tp)
    r, dk, dv = spec.group, spec.k_head_dim, spec.v_head_dim
    qkvz, ba = ck.take(a + "in_proj_qkvz.weight"), ck.take(a + "in_proj_ba.weight")
    per = 2 * dk + 2 * r * dv  # rows of one key head's group in qkvz
    hs = range(k0, k0 + nk)
    qkvz_rows = ([rows(qkvz, h * per, dk) for h in hs] + [rows(qkvz, h * per + dk, dk) for h in hs]
                 + [rows(qkvz, h * per + 2 * dk, r * dv) for h in hs]
                 + [rows(qkvz, h * per + 2 * dk + r * dv, r * dv) for h in hs])
    ba_rows = [rows(ba, h * 2 * r, r) for h in hs] + [rows(ba, h * 2 * r + r, r) for h in hs]
    return cat_rows(qkvz_rows), cat_rows(ba_rows), conv_rows(ck.take(a + "conv1d.weight"), spec, tp)


def gdn_weights(ck: Checkpoint, a: str, p: str, spec: GDNSpec, tp: TPGroup, in_proj: InProj) -> dict[str, Weight]:
    """A Gated DeltaNet layer at HF prefix `a` (…linear_attn.) -> GatedDeltaNet's parameters at `p`."""
    _, _, v0, nv = heads(spec, tp)
    qkvz, ba, conv = in_proj(ck, a, spec, tp)
    return {p + "in_proj_qkvz.weight": qkvz, p + "in_proj_ba.weight": ba, p + "conv_weight": conv,
            p + "A_log": rows(ck.take(a + "A_log"), v0, nv), p + "dt_bias": rows(ck.take(a + "dt_bias"), v0, nv),
            p + "norm.weight": ck.take(a + "norm.weight"),
            p + "out_proj.weight": cols(ck.take(a + "out_proj.weight"), v0, nv, spec.v_head_dim)}


def attention_weights(ck: Checkpoint, cfg: ModelConfig, a: str, p: str, tp: TPGroup) -> dict[str, Weight]:
    """A gated attention layer at HF prefix `a` (…self_attn.): q_proj's rows ([q|gate] per head) of this
    rank's heads, k/v of its KV heads, fused into qkv_proj; o_proj's columns; the q/k norms whole."""
    q0, nq = tp.split(cfg.num_heads, "num_attention_heads")
    k0, nk = tp.kv_heads(cfg.num_kv_heads)
    d = cfg.head_dim
    return {p + "qkv_proj.weight": cat_rows([rows(ck.take(a + "q_proj.weight"), q0, nq, 2 * d),
                                             rows(ck.take(a + "k_proj.weight"), k0, nk, d),
                                             rows(ck.take(a + "v_proj.weight"), k0, nk, d)]),
            p + "o_proj.weight": cols(ck.take(a + "o_proj.weight"), q0, nq, d),
            p + "q_norm.weight": ck.take(a + "q_norm.weight"), p + "k_norm.weight": ck.take(a + "k_norm.weight")}


def skip_extras(ck: Checkpoint, family: str) -> None:
    """Mark the weights this engine does not run as taken, with a log line each kind: multi-token-prediction
    layers (`mtp.*`) and a multimodal checkpoint's vision tower (`model.visual.*`, `visual.*`)."""
    for prefix, what in (("mtp.", "multi-token-prediction"), ("model.visual.", "vision tower"),
                         ("visual.", "vision tower")):
        names = [n for n in ck.raw if n.startswith(prefix)]
        if names:
            log.info("%s: ignoring the %s weights (%d under %s): not run by this engine (text only)", family, what,
                     len(names), prefix)
            for n in names:
                ck.skip(n)


def hybrid_weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup, in_proj: InProj,
                   prefix: str = "model.") -> dict[str, Weight]:
    """A Qwen3-Next-layout checkpoint (decoder under `prefix`) -> Model's parameters, sliced for tp.rank;
    `in_proj` maps a layer's Gated DeltaNet input projections and conv."""
    spec: GDNSpec = cfg.hybrid
    ck = Checkpoint(raw)
    skip_extras(ck, cfg.model_type)
    out = shell_weights(ck, cfg, tp, prefix)
    for i in range(cfg.num_layers):
        hf, ours = f"{prefix}layers.{i}.", f"layers.{i}."
        out[ours + "input_layernorm.weight"] = ck.take(hf + "input_layernorm.weight")
        out[ours + "post_attention_layernorm.weight"] = ck.take(hf + "post_attention_layernorm.weight")
        if i in spec.linear_layers:
            out |= gdn_weights(ck, hf + "linear_attn.", ours + "linear_attn.", spec, tp, in_proj)
        else:
            out |= attention_weights(ck, cfg, hf + "self_attn.", ours + "self_attn.", tp)
        if cfg.moe is not None and cfg.moe.sparse_layers[i]:
            out |= block_weights(ck, hf + "mlp.", ours + "mlp.", cfg.moe, tp, EXPERT_NAMES)
        else:
            out |= dense_mlp_weights(ck, hf + "mlp.", ours + "mlp.", cfg.intermediate_size, tp)
    ck.done()
    return out


def weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup = SINGLE) -> dict[str, Weight]:
    """HF names -> Model's, sliced for tp.rank (Qwen3-Next's grouped in_proj_qkvz / in_proj_ba re-ordered,
    experts stacked, `mtp.*` skipped)."""
    return hybrid_weights(raw, cfg, tp, grouped_in_proj)

