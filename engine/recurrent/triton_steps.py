"""Triton decode steps of the recurrent layers: one token per request, each request's state read from
and written back to its slot of the pool in place (no gather/scatter copies of the pool rows).

Same math, shapes and semantics as the torch steps they mirror, whose docstrings carry the math:
`conv1d_decode_step` = conv.causal_conv1d_step, `gdn_decode_step` = gated_delta.recurrent_gated_delta_step,
`ssd_decode_step` = ssd.ssd_step, each over slots as segments.run_segments runs a batch of one-token
segments (has_state[i] False: request i starts from a zero state and never reads its slot).

Programs: conv1d (B, channel blocks), a [BLOCK_C, K] tile of state|x; gated delta (B, H_v, d_v
blocks), the [d_k, BLOCK_V] slice of S in registers (S's columns are independent given k and q:
each program recomputes k's and q's L2 norms, d_k wide); SSD (B, H, head_dim blocks), a
[BLOCK_P, N] slice of the state. No tl.dot: every product is a broadcast and a reduction, in fp32.
Pools may be strided views (a layer of a [slots, layers, ...] pool): every stride is passed and slot
ids are widened to int64 before they scale one. Per-token inputs must have a unit last-dim stride.
Tested under TRITON_INTERPRET=1 on CPU tensors (tests/engine/test_recurrent_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.recurrent.ssd import NO_LIMIT


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _sum(x, axis: tl.constexpr):
    """tl.sum through this module's own combine function: tl.sum is a @jit of triton.language, decorated
    when triton is first imported, so a process that imported triton before setting TRITON_INTERPRET
    (transformers does) cannot interpret it; this one follows the mode this module was imported in."""
    return tl.reduce(x, axis, _add)


@triton.jit
def conv1d_step_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, state_ptr, slot_ptr, has_ptr, C,
                       stride_xb, stride_wc, stride_yb, stride_ss, stride_sc, stride_sk,
                       KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_FLAGS: tl.constexpr,
                       BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    offs_j = tl.arange(0, BLOCK_K)
    cm = offs_c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    sp = state_ptr + slot * stride_ss + offs_c[:, None] * stride_sc
    old = cm[:, None] & (offs_j[None, :] < KW - 1)
    st = tl.load(sp + offs_j[None, :] * stride_sk, mask=old, other=0.0).to(tl.float32)
    if HAS_FLAGS:
        st = tl.where(tl.load(has_ptr + b) != 0, st, 0.0)
    x = tl.load(x_ptr + b * stride_xb + offs_c, mask=cm, other=0.0).to(tl.float32)
    xs = tl.where(offs_j[None, :] == KW - 1, x[:, None], st)  # [BLOCK_C, BLOCK_K]: state | x, oldest first
    w = tl.load(w_ptr + offs_c[:, None] * stride_wc + offs_j[None, :],
                mask=cm[:, None] & (offs_j[None, :] < KW), other=0.0).to(tl.float32)
    y = _sum(xs * w, 1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_c, mask=cm, other=0.0).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    tl.store(y_ptr + b * stride_yb + offs_c, y.to(y_ptr.dtype.element_ty), mask=cm)
    # shift left by one: column j of state|x becomes column j - 1 of the new state
    new = cm[:, None] & (offs_j[None, :] >= 1) & (offs_j[None, :] < KW)
    tl.store(sp + (offs_j[None, :] - 1) * stride_sk, xs.to(state_ptr.dtype.element_ty), mask=new)


@triton.jit
def gdn_step_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, slot_ptr, has_ptr, DK, DV, scale,
                    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_gb, stride_bb,
                    stride_ob, stride_oh, stride_ss, stride_sh, stride_sk, stride_sv,
                    GROUP: tl.constexpr, L2NORM: tl.constexpr, HAS_FLAGS: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    km = offs_k < DK
    vm = offs_v < DV
    q = tl.load(q_ptr + b * stride_qb + hk * stride_qh + offs_k, mask=km, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + offs_k, mask=km, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * (1.0 / tl.sqrt(_sum(q * q, 0) + 1e-6))
        k = k * (1.0 / tl.sqrt(_sum(k * k, 0) + 1e-6))
    q = q * scale
    v = tl.load(v_ptr + b * stride_vb + h * stride_vh + offs_v, mask=vm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * stride_gb + h).to(tl.float32)
    beta = tl.load(beta_ptr + b * stride_bb + h).to(tl.float32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    sp = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    sm = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    if HAS_FLAGS:
        s = tl.where(tl.load(has_ptr + b) != 0, s, 0.0)
    s = s * tl.exp(g)
    delta = (v - _sum(s * k[:, None], 0)) * beta  # v - S^T k
    s = s + k[:, None] * delta[None, :]
    o = _sum(s * q[:, None], 0)  # S^T q
    tl.store(sp, s.to(state_ptr.dtype.element_ty), mask=sm)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_v, o.to(o_ptr.dtype.element_ty), mask=vm)


@triton.jit
def ssd_step_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, y_ptr, state_ptr, slot_ptr, has_ptr,
                    P, N, dt_min, dt_max,
                    stride_xb, stride_xh, stride_dtb, stride_bb, stride_bg, stride_cb, stride_cg,
                    stride_yb, stride_yh, stride_ss, stride_sh, stride_sp, stride_sn,
                    REP: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                    LIMIT: tl.constexpr, HAS_FLAGS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // REP
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    pm = offs_p < P
    nm = offs_n < N
    dt = tl.load(dt_ptr + b * stride_dtb + h).to(tl.float32)
    if HAS_DT_BIAS:
        dt += tl.load(dt_bias_ptr + h).to(tl.float32)
    if SOFTPLUS:
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)  # torch's threshold 20
    if LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    decay = tl.exp(dt * tl.load(a_ptr + h).to(tl.float32))
    x = tl.load(x_ptr + b * stride_xb + h * stride_xh + offs_p, mask=pm, other=0.0).to(tl.float32)
    bv = tl.load(b_ptr + b * stride_bb + grp * stride_bg + offs_n, mask=nm, other=0.0).to(tl.float32)
    cv = tl.load(c_ptr + b * stride_cb + grp * stride_cg + offs_n, mask=nm, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    sp = state_ptr + slot * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    sm = pm[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    if HAS_FLAGS:
        s = tl.where(tl.load(has_ptr + b) != 0, s, 0.0)
    s = s * decay + (dt * x)[:, None] * bv[None, :]
    y = _sum(s * cv[None, :], 1)
    if HAS_D:
        y += tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(sp, s.to(state_ptr.dtype.element_ty), mask=sm)
    tl.store(y_ptr + b * stride_yb + h * stride_yh + offs_p, y.to(y_ptr.dtype.element_ty), mask=pm)


def _flags(has_state: list[bool] | torch.Tensor | None, slots: torch.Tensor) -> torch.Tensor:
    if has_state is None:
        return slots  # unread (HAS_FLAGS False): any int tensor on the device
    return torch.as_tensor(has_state, device=slots.device).to(torch.int32)


def _unit_last(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.stride(-1) != 1:
            raise ValueError(f"a per-token input of shape {tuple(t.shape)} has last-dim stride {t.stride(-1)}, not 1")


def conv1d_decode_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, slots: torch.Tensor,
                       states: torch.Tensor, has_state: list[bool] | torch.Tensor | None = None,
                       activation: str | None = "silu", block_c: int = 128) -> torch.Tensor:
    """x [B, C], weight [C, K], bias [C] | None, slots [B], states [slots, C, K-1] (in place) -> y [B, C]."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"conv1d activation {activation!r} is not one this engine runs (silu or None)")
    _unit_last(x, weight)
    bsz, c = x.shape
    kw = weight.shape[1]
    y = torch.empty_like(x)
    grid = (bsz, triton.cdiv(c, block_c))
    conv1d_step_kernel[grid](
        x, weight, bias if bias is not None else weight, y, states, slots, _flags(has_state, slots), c,
        x.stride(0), weight.stride(0), y.stride(0), states.stride(0), states.stride(1), states.stride(2),
        KW=kw, HAS_BIAS=bias is not None, SILU=activation is not None, HAS_FLAGS=has_state is not None,
        BLOCK_C=block_c, BLOCK_K=triton.next_power_of_2(kw))
    return y


def gdn_decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    slots: torch.Tensor, states: torch.Tensor, has_state: list[bool] | torch.Tensor | None = None, *,
                    use_qk_l2norm: bool = True, scale: float | None = None, block_v: int = 32) -> torch.Tensor:
    """q, k [B, H_k, d_k], v [B, H_v, d_v], g, beta [B, H_v], slots [B], states [slots, H_v, d_k, d_v]
    (in place) -> o [B, H_v, d_v] in v's dtype."""
    _unit_last(q, k, v, g, beta)
    bsz, hk, dk = k.shape
    hv, dv = v.shape[1:]
    o = torch.empty_like(v)
    block_v = min(block_v, triton.next_power_of_2(dv))
    grid = (bsz, hv, triton.cdiv(dv, block_v))
    gdn_step_kernel[grid](
        q, k, v, g, beta, o, states, slots, _flags(has_state, slots), dk, dv,
        scale if scale is not None else dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), states.stride(0), states.stride(1), states.stride(2), states.stride(3),
        GROUP=hv // hk, L2NORM=use_qk_l2norm, HAS_FLAGS=has_state is not None,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v)
    return o


def ssd_decode_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
                    slots: torch.Tensor, states: torch.Tensor, has_state: list[bool] | torch.Tensor | None = None, *,
                    D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,  # noqa: N803
                    dt_softplus: bool = True, dt_limit: tuple[float, float] = NO_LIMIT,
                    block_p: int = 32) -> torch.Tensor:
    """x [B, H, P], dt [B, H] (raw), A, D, dt_bias [H], B, C [B, G, N], slots [B], states [slots, H, P, N]
    (in place) -> y [B, H, P] in x's dtype."""
    _unit_last(x, dt, B, C)
    bsz, nh, hp = x.shape
    ns = B.shape[-1]
    y = torch.empty_like(x)
    block_p = min(block_p, triton.next_power_of_2(hp))
    grid = (bsz, nh, triton.cdiv(hp, block_p))
    limit = tuple(dt_limit) != NO_LIMIT
    ssd_step_kernel[grid](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, y, states, slots,
        _flags(has_state, slots), hp, ns, float(dt_limit[0]), float(dt_limit[1]) if limit else 0.0,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        y.stride(0), y.stride(1), states.stride(0), states.stride(1), states.stride(2), states.stride(3),
        REP=nh // B.shape[1], HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus,
        LIMIT=limit, HAS_FLAGS=has_state is not None, BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(ns))
    return y
