"""What the Mamba2 hybrids (Nemotron-H: nemotron_h.py, Granite-4.0-H: granitemoehybrid.py) share: the
Mamba2 mixer, an attention layer with an optional rope and its own softmax scale, the decoder shell
holding them, and the config and checkpoint helpers.

Mamba2 mixer, per token (shapes for this rank: T tokens, H heads of P dims, G groups of N state dims,
I = H * P, K = conv kernel):
    z | xBC | dt = in_proj(x)                  z [T, I], xBC = x|B|C [T, I + 2GN], dt [T, H]
    xBC = silu(causal_conv1d(xBC))             depthwise over time, state: the last K-1 inputs
    y = SSD(x, dt, A = -exp(A_log), B, C, D)   engine/recurrent/ssd.py: dt = softplus(dt + dt_bias),
                                               clamped to time_step_limit; state [H, P, N] fp32
    y = rmsnorm_g(y * silu(z)) * norm.weight   RMS over each group of I/G channels (the gate first)
    out = out_proj(y)
The conv and SSD run through `ctx.state` (engine/recurrent/batch.py: packed segments, each with its
state slot, updated in place), so a prompt prefilled in chunks and then decoded continues exactly.

Tensor parallelism: the mixer's heads are split across ranks (z, x and dt rows of in_proj, A_log, D,
dt_bias, the norm weight, out_proj's columns), B and C by group when the group count divides by the
TP size, else each rank holds the one group its heads read (replicated, as KV heads are); the conv
channels are x|B|C sliced the same way. out_proj is row-parallel (rank 0 adds the residual and the
bias). A norm group split across ranks (TP size above n_groups) sums its squares with one small
all-reduce [T, G]. Attention is split by head as layers.Attention is.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models import cpu_gemm
from engine.models.checkpoint import Checkpoint, cat_rows, cols, rows
from engine.models.layers import ForwardContext, RMSNorm, embedding, linear, row_parallel
from engine.models.rope import Rotary, RotaryTables
from engine.recurrent.ssd import NO_LIMIT
from engine.recurrent.state_pool import StatePart, StateSpec


@dataclass(frozen=True)
class Mamba2Spec:
    """A Mamba2 mixer's shape, as config.json gives it (global sizes, before any TP split)."""

    num_heads: int  # H
    head_dim: int  # P
    n_groups: int  # G: B and C come in G groups; head h reads group h // (H / G)
    d_state: int  # N
    conv_kernel: int  # K
    chunk_size: int  # the SSD scan's chunk (results do not depend on it beyond rounding)
    conv_bias: bool
    proj_bias: bool  # in_proj and out_proj biases
    norm_eps: float  # the gated RMSNorm's epsilon
    dt_limit: tuple[float, float] = NO_LIMIT  # time_step_limit: dt clamped after softplus
    fields: tuple[str, str] = ("num_heads", "n_groups")  # config.json names of H and G, for TP errors

    @property
    def intermediate(self) -> int:
        """I = H * P: the width of z, x and the gated norm."""
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: x | B | C."""
        return self.intermediate + 2 * self.n_groups * self.d_state


def need_int(raw: dict, key: str, default: object = None, minimum: int = 1) -> int:
    """config.json's integer `key` (>= minimum); else ValueError naming it."""
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"config.json field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def json_float(v: object) -> float | None:
    """A number of config.json: plain, or transformers 5's {"__float__": "Infinity"} encoding."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        v = v["__float__"]
    if isinstance(v, bool):
        return None
    try:
        return float(v)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def dt_limit(raw: dict, key: str, value: object) -> tuple[float, float]:
    """time_step_limit [lo, hi] with 0 <= lo <= hi (hi may be Infinity); else ValueError naming `key`.
    The engine clamps dt in the chunked scan and the decode step alike (transformers' decode step does
    not clamp; with the default (0, inf) the clamp is the identity and both agree)."""
    pair = value if isinstance(value, (list, tuple)) else None
    lo, hi = (json_float(pair[0]), json_float(pair[1])) if pair is not None and len(pair) == 2 else (None, None)
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi) or not 0 <= lo <= hi:
        raise ValueError(f"config.json field {key!r} must be [min, max] with 0 <= min <= max, got {value!r}")
    return lo, hi


def attention_layers(kinds: tuple[str, ...], field: str) -> tuple[int, ...]:
    """Ids of the layers of kind "attention" (the only ones the KV pool holds); a model without one is
    refused naming `field` (the engine's KV pool and page accounting assume attention layers)."""
    ids = tuple(i for i, k in enumerate(kinds) if k == "attention")
    if not ids:
        raise ValueError(f"config.json field {field!r} has no attention layer: a pure Mamba2 model is not "
                         "supported by this engine")
    return ids


def residual_out(m: nn.Linear, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup,
                 scale: float = 1.0, lora: Any = None, layer: int = -1) -> torch.Tensor:
    """residual + scale * m(x) for a row-parallel m (summed over the group). scale 1: the add fused
    into rank 0's GEMM (layers.row_parallel); else the sum first, then the scaled add (Granite's
    residual_multiplier: residual + (m(x) * scale), the order transformers computes it in). `lora`
    (ForwardContext.lora): the adapters' update of o_proj in `layer` added to m(x)."""
    if lora is not None:
        if scale == 1.0:
            return lora.row_parallel(m, x, residual, tp, layer, "o")
        return residual + tp.all_reduce(lora.apply(layer, "o", x, linear(m, x))) * scale
    if scale == 1.0:
        return row_parallel(m, x, residual, tp)
    return residual + tp.all_reduce(linear(m, x)) * scale


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer's mixer, this rank's heads (module docstring). Parameters: in_proj [2I + 2GN + H,
    hidden] (z, x, B, C, dt rows), conv_weight [I + 2GN, K] (the checkpoint's conv1d.weight squeezed),
    conv_bias, A_log, D, dt_bias [H], norm_weight [I], out_proj [hidden, I]."""

    def __init__(self, spec: Mamba2Spec, hidden: int, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.spec, self.layer_id, self.tp = spec, layer_id, tp
        self.h0, self.nh = tp.split(spec.num_heads, spec.fields[0])
        self.g0, self.ng = tp.kv_heads(spec.n_groups, spec.fields[1])
        p, n = spec.head_dim, spec.d_state
        self.inner = self.nh * p  # this rank's z / x / norm channels
        self.conv_channels = self.inner + 2 * self.ng * n
        self.in_proj = nn.Linear(hidden, self.inner + self.conv_channels + self.nh, bias=spec.proj_bias)
        self.conv_weight = nn.Parameter(torch.empty(self.conv_channels, spec.conv_kernel), requires_grad=False)
        self.conv_bias = nn.Parameter(torch.empty(self.conv_channels), requires_grad=False) if spec.conv_bias \
            else None
        self.A_log = nn.Parameter(torch.empty(self.nh), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.nh), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.nh), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.inner), requires_grad=False)
        self.out_proj = nn.Linear(self.inner, hidden, bias=spec.proj_bias and tp.driver)
        self.group_size = spec.intermediate // spec.n_groups  # channels of one norm group
        self.norm_shared = tp.size > spec.n_groups  # this rank holds part of one norm group
        self.conv_name, self.ssm_name = f"{layer_id}.conv", f"{layer_id}.ssm"

    def state_parts(self, tp: TPGroup | None = None) -> list[StatePart]:
        """This layer's parts of a request's state slot: the conv window [I + 2GN, K-1] in the conv weight's
        dtype and the SSM state [H, P, N] fp32 (this rank's channels and heads, or rank `tp`'s), each
        naming its rows of the whole layer's (x|B|C channels, heads)."""
        s, tp = self.spec, tp or self.tp
        h0, nh = tp.split(s.num_heads, s.fields[0])
        return [StatePart(self.conv_name, (self.conv_channels, s.conv_kernel - 1), self.conv_weight.dtype,
                          xbc_runs(s, tp), s.conv_dim),
                StatePart(self.ssm_name, (self.nh, s.head_dim, s.d_state), torch.float32, ((h0, nh),), s.num_heads)]

    def forward(self, x: torch.Tensor, residual: torch.Tensor, ctx: ForwardContext,
                scale: float = 1.0) -> torch.Tensor:
        """x (normed), residual [T, hidden] -> residual + scale * mixer(x) (summed over the group)."""
        if ctx.state is None:
            raise RuntimeError(f"layer {self.layer_id} is a Mamba2 layer: its forward needs state slots "
                               "(ForwardContext.state)")
        s, t = self.spec, x.shape[0]
        z, xbc, dt = linear(self.in_proj, x).split([self.inner, self.conv_channels, self.nh], dim=-1)
        xbc = ctx.state.conv(self.conv_name, xbc, self.conv_weight, self.conv_bias, "silu")
        xs, b, c = xbc.split([self.inner, self.ng * s.d_state, self.ng * s.d_state], dim=-1)
        y = ctx.state.ssd(self.ssm_name, xs.reshape(t, self.nh, s.head_dim), dt, -self.A_log.float().exp(),
                          b.reshape(t, self.ng, s.d_state), c.reshape(t, self.ng, s.d_state), D=self.D,
                          dt_bias=self.dt_bias, dt_limit=s.dt_limit, chunk_size=s.chunk_size)  # [T, H, P]
        y = self.gated_norm(y.reshape(t, self.inner), z).to(x.dtype)
        return residual_out(self.out_proj, y, residual, self.tp, scale)

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z [T, I] -> fp32 weight * rmsnorm_g(y * silu(z)): the gate before the norm (transformers'
        MambaRMSNormGated, norm_before_gate False), mean of squares over each group of I/G channels."""
        h = y.float() * F.silu(z.float())
        t = h.shape[0]
        if not self.norm_shared:  # whole groups on this rank
            g = h.view(t, -1, self.group_size)
            h = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.spec.norm_eps)).view(t, -1)
        else:  # a share of group g0: its squares summed over the ranks holding the group
            sq = h.new_zeros(t, self.spec.n_groups)
            sq[:, self.g0] = h.pow(2).sum(-1)
            var = self.tp.all_reduce(sq)[:, self.g0 : self.g0 + 1] / self.group_size
            h = h * torch.rsqrt(var + self.spec.norm_eps)
        return self.norm_weight.float() * h


class HybridAttention(nn.Module):
    """Causal self-attention of a hybrid model over the paged pool (its index among the attention layers:
    cfg.kv_index): fused q/k/v (this rank's heads, biases per cfg.qkv_bias / cfg.o_bias), rope when
    `rope` (Granite with position_embedding_type rope; Nemotron-H has none), softmax scale `scale`
    (None: head_dim^-1/2, the runner's)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE, rope: bool = False,
                 scale: float | None = None) -> None:
        super().__init__()
        self.layer_id, self.tp, self.rope = layer_id, tp, rope
        self.kv_layer = cfg.kv_index(layer_id)
        self.hq = tp.split(cfg.num_heads, "num_attention_heads")[1]
        self.hkv = tp.kv_heads(cfg.num_kv_heads)[1]
        self.d = d = cfg.head_dim
        self.scale = d ** -0.5 if scale is None else float(scale)
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.hq * d, cfg.hidden_size, bias=cfg.o_bias and tp.driver)

    def forward(self, x: torch.Tensor, residual: torch.Tensor, ctx: ForwardContext, rotary: RotaryTables | None,
                scale: float = 1.0) -> torch.Tensor:
        """x (normed), residual [T, hidden] -> residual + scale * attention(x) (summed over the group)."""
        t = x.shape[0]
        qkv = linear(self.qkv_proj, x)  # [T, (Hq + 2Hkv) D]
        if ctx.lora is not None:  # each adapter's rows += x A^T B^T (engine/extras/lora)
            ctx.lora.apply(self.layer_id, "qkv", x, qkv)
        k_pages, v_pages = ctx.pool.layer(self.kv_layer)
        if self.rope and ctx.native is not None:  # rotate q and k, store k and v: one call
            q = ctx.native.rope_store(qkv, rotary.cos, rotary.sin, k_pages, v_pages, ctx.out_page, ctx.out_offset,
                                      self.hq, self.hkv, self.d)
        else:
            q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
            q, k, v = q.view(t, self.hq, self.d), k.view(t, self.hkv, self.d), v.view(t, self.hkv, self.d)
            if self.rope:
                q, k = rotary(q), rotary(k)
            ctx.pool.write(self.kv_layer, ctx.out_page, ctx.out_offset, k, v)
        meta = ctx.meta if ctx.meta.scale == self.scale else dataclasses.replace(ctx.meta, scale=self.scale)
        o = ctx.backend.forward(q, k_pages, v_pages, meta, 0)  # [T, Hq, D]
        return residual_out(self.o_proj, o.reshape(t, self.hq * self.d), residual, self.tp, scale, ctx.lora,
                            self.layer_id)


class HybridLM(nn.Module):
    """Embedding (times `embedding_multiplier`) -> the family's layers (each forward(x, rotary, ctx) -> x)
    -> final RMSNorm; `logits` (rank 0 only) divided by `logits_scaling`. Parameter names: embed_tokens,
    layers.N.*, norm, lm_head (untied, rank 0 only)."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup, layers: list[nn.Module], *, rope: bool = False,
                 embedding_multiplier: float = 1.0, logits_scaling: float = 1.0) -> None:
        super().__init__()
        self.cfg, self.tp, self.rope = cfg, tp, rope
        self.embedding_multiplier, self.logits_scaling = embedding_multiplier, logits_scaling
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_pos)  # rebuilt by the loader
        untied_head = not cfg.tie_embeddings and tp.driver
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if untied_head else None

    def _attention(self) -> HybridAttention:
        return next(m for m in self.modules() if isinstance(m, HybridAttention))

    @property
    def local_heads(self) -> int:
        """Query heads this rank computes."""
        return self._attention().hq

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank computes and keeps in its pool (attention layers only)."""
        return self._attention().hkv

    def state_spec(self, tp: TPGroup | None = None) -> StateSpec:
        """A request's recurrent state on this rank (or on rank `tp` of its group): each Mamba2 layer's conv
        window and SSM state."""
        return StateSpec(tuple(p for m in self.modules() if isinstance(m, Mamba2Mixer) for p in m.state_parts(tp)))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final hidden states [T, H] (the same on every rank)."""
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        rotary = self.rotary.tables(positions) if self.rope else None
        for layer in self.layers:
            x = layer(x, rotary, ctx)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, vocab] (divided by logits_scaling); rank 0 only."""
        if not self.tp.driver:
            raise RuntimeError("logits are computed on tensor-parallel rank 0 only")
        out = cpu_gemm.linear(hidden, self.lm_head_weight(), getattr(self, "lm_packed", None))
        if self.logits_scaling != 1.0:
            out = out / self.logits_scaling
        return out.float()

    def lm_head_weight(self) -> torch.Tensor | None:
        """The output head's weight [vocab, H] (the embedding when tied); None on ranks other than 0."""
        if not self.tp.driver:
            return None
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight


def xbc_runs(spec: Mamba2Spec, tp: TPGroup) -> tuple[tuple[int, int], ...]:
    """(first, count) runs of the whole x|B|C channels (the convolution's) that are this rank's: its heads'
    x channels, its groups' B and C channels (a group held by several ranks when the group is larger than G)."""
    h0, nh = tp.split(spec.num_heads, spec.fields[0])
    g0, ng = tp.kv_heads(spec.n_groups, spec.fields[1])
    p, n, inner, gn = spec.head_dim, spec.d_state, spec.intermediate, spec.n_groups * spec.d_state
    return (h0 * p, nh * p), (inner + g0 * n, ng * n), (inner + gn + g0 * n, ng * n)


def mixer_weights(ck: Checkpoint, hf: str, ours: str, spec: Mamba2Spec, tp: TPGroup) -> dict[str, torch.Tensor]:
    """A Mamba2 mixer at HF prefix `hf` (in_proj, conv1d, A_log, D, dt_bias, norm, out_proj) as Mamba2Mixer's
    parameters at `ours`, this rank's heads and groups (module docstring)."""
    h0, nh = tp.split(spec.num_heads, spec.fields[0])
    p, inner, gn = spec.head_dim, spec.intermediate, spec.n_groups * spec.d_state

    def xbc(w: torch.Tensor, base: int) -> list[torch.Tensor]:  # x | B | C rows starting at row `base`
        return [rows(w, base + first, count) for first, count in xbc_runs(spec, tp)]

    def in_proj(w: torch.Tensor) -> torch.Tensor:  # z | x | B | C | dt
        return cat_rows([rows(w, h0 * p, nh * p), *xbc(w, inner), rows(w, 2 * inner + 2 * gn + h0, nh)])

    conv = ck.take(hf + "conv1d.weight")
    if conv.dim() != 3 or conv.shape[1] != 1:
        raise ValueError(f"weight {hf}conv1d.weight: shape {tuple(conv.shape)} is not a depthwise conv [C, 1, K]")
    out = {ours + "in_proj.weight": in_proj(ck.take(hf + "in_proj.weight")),
           ours + "conv_weight": torch.cat(xbc(conv[:, 0], 0)),
           ours + "A_log": ck.take(hf + "A_log")[h0 : h0 + nh], ours + "D": ck.take(hf + "D")[h0 : h0 + nh],
           ours + "dt_bias": ck.take(hf + "dt_bias")[h0 : h0 + nh],
           ours + "norm_weight": ck.take(hf + "norm.weight")[h0 * p : (h0 + nh) * p],
           ours + "out_proj.weight": cols(ck.take(hf + "out_proj.weight"), h0 * p, nh * p)}
    if spec.conv_bias:
        out[ours + "conv_bias"] = torch.cat(xbc(ck.take(hf + "conv1d.bias"), 0))
    if spec.proj_bias:
        out[ours + "in_proj.bias"] = in_proj(ck.take(hf + "in_proj.bias"))
        if tp.driver:
            out[ours + "out_proj.bias"] = ck.take(hf + "out_proj.bias")
        else:
            ck.skip(hf + "out_proj.bias")
    return out


def qkv_weights(ck: Checkpoint, cfg: ModelConfig, hf: str, ours: str, tp: TPGroup) -> dict[str, torch.Tensor]:
    """q/k/v/o at HF prefix `hf` as HybridAttention's qkv_proj (this rank's heads) and o_proj (its columns;
    the bias on rank 0 only)."""
    q0, nq = tp.split(cfg.num_heads, "num_attention_heads")
    k0, nk = tp.kv_heads(cfg.num_kv_heads)
    d, out = cfg.head_dim, {}
    for kind in ["weight", "bias"] if cfg.qkv_bias else ["weight"]:
        out[ours + f"qkv_proj.{kind}"] = cat_rows([
            rows(ck.take(hf + f"q_proj.{kind}"), q0, nq, d), rows(ck.take(hf + f"k_proj.{kind}"), k0, nk, d),
            rows(ck.take(hf + f"v_proj.{kind}"), k0, nk, d)])
    out[ours + "o_proj.weight"] = cols(ck.take(hf + "o_proj.weight"), q0, nq, d)
    if cfg.o_bias:
        if tp.driver:
            out[ours + "o_proj.bias"] = ck.take(hf + "o_proj.bias")
        else:
            ck.skip(hf + "o_proj.bias")
    return out
