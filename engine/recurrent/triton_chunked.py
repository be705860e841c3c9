"""Triton prefill kernels of the recurrent layers: a packed varlen batch of segments (engine/recurrent/
segments.py's layout: per-token inputs packed along dim 0, segment i of seq_lens[i] tokens continuing
from its slot of the pool, or from zeros where has_state[i] is False), each segment's final state
written back to its slot in place (no gather/scatter copies of the pool rows).

Same math and semantics as the torch forms they mirror, whose docstrings carry the math:
`gdn_prefill` = gated_delta.gated_delta_varlen (chunked WY / UT form), `ssd_prefill` = ssd.ssd_varlen
(Mamba2's chunked SSD scan), `conv1d_prefill` = conv.causal_conv1d_varlen. A segment of one token is
one (mostly padded) chunk, so a mixed batch (prompt chunks and decode tokens) is one launch of each.

Programs and chunks:
- gated delta: (segment, value head, d_v block); the [d_k, BLOCK_V] slice of S lives in registers
  across the segment's chunks of CHUNK tokens (S's columns are independent given k, q and the
  chunk's W). Per chunk: Gamma = cumsum(g), A = tril_strict(diag(beta) K K^T * exp(Gamma_i - Gamma_j)),
  (I + A)^-1 by forward substitution (CHUNK - 1 row steps on a [CHUNK, CHUNK] tile), U and W, then
  V' = U - W S, O = (Q exp(Gamma)) S + (Q K^T * decay)_causal V', S <- exp(Gamma_last) S +
  (K exp(Gamma_last - Gamma))^T V'. q / k L2 norm and the scale as gated_delta._prep.
- SSD: two launches. `ssd_cb_kernel`, (chunk of any segment, group): C B^T [L, L] of each chunk, once
  per GROUP (not per head), into a scratch [chunks, G, L, L]; `ssd_chunked_kernel`, (segment, head,
  head_dim block): the [BLOCK_P, N] slice of the state in registers across the segment's chunks, each
  chunk's Y = (CB * exp(segsum(a)))  (dt x) + exp(cumsum a) C H_start + D x and
  H <- exp(sum a) H + (dt x exp(a_last - cumsum a))^T B. dt bias / softplus / limit as ssd._dt;
  tokens past a segment's end have dt = 0 after softplus (no decay, no input) as ssd.py pads them.
  The kernel's chunk length L is its own (default 64), not the model's chunk_size (128, 256): the
  result does not depend on it beyond rounding, and an [L, L] tile of 256 would not fit registers.
- conv1d: (block of BLOCK_T tokens of any segment, channel block); the block that starts a segment
  is the only one that reads the old state (BLOCK_T >= K - 1), and it also writes the new state (the
  segment's last K - 1 inputs, part old state when the segment is shorter than K - 1), after a
  barrier, so no program reads a state another has already overwritten.

Conventions as triton_steps.py: pools may be strided views (a layer of a [slots, layers, ...] pool,
every stride passed), slot ids and token offsets are int64 before they scale a stride, per-token inputs
are copied to a unit last-dim stride only if they lack one, fp32 accumulation throughout. Reductions
and scans go through tl.reduce / tl.associative_scan with triton's own `_sum_combine` (the interpreter
runs that combine as numpy, where a combine of this module's would run element by element in Python;
`tl.sum` itself is a @jit decorated at triton's import, which a process that imported triton before
setting TRITON_INTERPRET cannot interpret). Products are tl.dot in "tf32" precision with fp32
accumulation (the interpreter computes them in fp32; in "ieee" precision the sm_90 compile of the
SSD kernels spilled kilobytes of registers to the stack) with every dimension at least 16 (the smallest
MMA tile): head dims and chunks are padded to powers of two >= 16 and masked.
Tested under TRITON_INTERPRET=1 on CPU tensors (tests/engine/test_recurrent_chunked_triton.py) and
compiled for sm_90 (tests/unit/triton/test_sm90_compile.py): conv1d and the SSD kernels compile with no
spills; `gdn_chunked_kernel` still spills (~1 KB of stack at d_k 128 even at 8 warps, chunk 32, BLOCK_V 16),
so CUDA prefill of Gated DeltaNet stays on the torch form (engine/recurrent/batch.py, GDN_CHUNKED_ON_CUDA)
until its tiles are split (the [CHUNK, d_k] q / k tiles and the [d_k, BLOCK_V] state slice at once).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.recurrent.ssd import NO_LIMIT

_SUM = tl.standard._sum_combine


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM)


@triton.jit
def _cumsum(x, axis: tl.constexpr):
    return tl.associative_scan(x, axis, _SUM)


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="tf32")  # see the module docstring


# --- gated delta rule -------------------------------------------------------------------------


@triton.jit
def gdn_chunked_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, state_ptr, cu_ptr, slot_ptr, has_ptr,
                       DK, DV, scale,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                       stride_ot, stride_oh, stride_ss, stride_sh, stride_sk, stride_sv,
                       GROUP: tl.constexpr, L2NORM: tl.constexpr, HAS_FLAGS: tl.constexpr, CH: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    km = offs_k < DK
    vm = offs_v < DV
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    slot = tl.load(slot_ptr + b).to(tl.int64)
    sp = state_ptr + slot * stride_ss + h * stride_sh + offs_k[:, None] * stride_sk + offs_v[None, :] * stride_sv
    sm = km[:, None] & vm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]
    if HAS_FLAGS:
        s = tl.where(tl.load(has_ptr + b) != 0, s, 0.0)
    rows = tl.arange(0, CH)
    eye = rows[:, None] == rows[None, :]
    lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    for c0 in range(0, n, CH):
        tm = (c0 + rows) < n
        tok = start + c0 + rows
        qk_mask = tm[:, None] & km[None, :]
        q = tl.load(q_ptr + tok[:, None] * stride_qt + hk * stride_qh + offs_k[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)  # [CH, BLOCK_K]
        k = tl.load(k_ptr + tok[:, None] * stride_kt + hk * stride_kh + offs_k[None, :], mask=qk_mask,
                    other=0.0).to(tl.float32)
        if L2NORM:
            q = q * (1.0 / tl.sqrt(_sum(q * q, 1) + 1e-6))[:, None]
            k = k * (1.0 / tl.sqrt(_sum(k * k, 1) + 1e-6))[:, None]
        q = q * scale
        v = tl.load(v_ptr + tok[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=tm[:, None] & vm[None, :], other=0.0).to(tl.float32)  # [CH, BLOCK_V]
        g = tl.load(g_ptr + tok * stride_gt + h, mask=tm, other=0.0).to(tl.float32)  # pad: g = 0, beta = 0
        beta = tl.load(beta_ptr + tok * stride_bt + h, mask=tm, other=0.0).to(tl.float32)
        gam = _cumsum(g, 0)
        decay = tl.where(causal, tl.exp(tl.where(causal, gam[:, None] - gam[None, :], 0.0)), 0.0)
        kb = k * beta[:, None]
        a = tl.where(lower, _dot(kb, tl.trans(k)) * decay, 0.0)
        # T^-1 = (I + A)^-1, unit lower triangular, by rows: row i = e_i - sum_{j<i} A[i, j] row j
        t_inv = tl.where(eye, 1.0, 0.0)
        for i in range(1, CH):
            a_i = _sum(tl.where(rows[:, None] == i, a, 0.0), 0)  # row i of A, over columns j
            row = tl.where(rows == i, 1.0, 0.0) - _sum(a_i[:, None] * t_inv, 0)
            t_inv = tl.where(rows[:, None] == i, row[None, :], t_inv)
        u = _dot(t_inv, v * beta[:, None])  # [CH, BLOCK_V]
        w = _dot(t_inv, kb * tl.exp(gam)[:, None])  # [CH, BLOCK_K]
        v_new = u - _dot(w, s)
        attn = tl.where(causal, _dot(q, tl.trans(k)) * decay, 0.0)
        o = _dot(q * tl.exp(gam)[:, None], s) + _dot(attn, v_new)
        tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_v[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=tm[:, None] & vm[None, :])
        g_last = _sum(g, 0)  # Gamma at the chunk's end (pad tokens add 0)
        s = s * tl.exp(g_last) + _dot(tl.trans(k * tl.exp(g_last - gam)[:, None]), v_new)
    tl.store(sp, s.to(state_ptr.dtype.element_ty), mask=sm)


# --- Mamba2 SSD ---------------------------------------------------------------------------------


@triton.jit
def ssd_cb_kernel(b_ptr, c_ptr, cb_ptr, cu_ptr, cseg_ptr, cfirst_ptr, N,
                  stride_bt, stride_bg, stride_ct, stride_cg, stride_cbc, stride_cbg,
                  L: tl.constexpr, BLOCK_N: tl.constexpr):
    cid = tl.program_id(0)
    grp = tl.program_id(1)
    seg = tl.load(cseg_ptr + cid)
    first = tl.load(cfirst_ptr + cid)
    start = tl.load(cu_ptr + seg)
    n = tl.load(cu_ptr + seg + 1) - start
    rows = tl.arange(0, L)
    offs_n = tl.arange(0, BLOCK_N)
    tm = (first + rows) < n
    tok = start + first + rows
    m = tm[:, None] & (offs_n[None, :] < N)
    bv = tl.load(b_ptr + tok[:, None] * stride_bt + grp * stride_bg + offs_n[None, :], mask=m, other=0.0)
    cv = tl.load(c_ptr + tok[:, None] * stride_ct + grp * stride_cg + offs_n[None, :], mask=m, other=0.0)
    cb = _dot(cv.to(tl.float32), tl.trans(bv.to(tl.float32)))  # [L (to), L (from)]
    tl.store(cb_ptr + cid.to(tl.int64) * stride_cbc + grp * stride_cbg + rows[:, None] * L + rows[None, :], cb)


@triton.jit
def ssd_chunked_kernel(x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, dt_bias_ptr, cb_ptr, y_ptr, state_ptr,
                       cu_ptr, coff_ptr, slot_ptr, has_ptr, P, N, dt_min, dt_max,
                       stride_xt, stride_xh, stride_dtt, stride_bt, stride_bg, stride_ct, stride_cg,
                       stride_cbc, stride_cbg, stride_yt, stride_yh, stride_ss, stride_sh, stride_sp, stride_sn,
                       REP: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr, SOFTPLUS: tl.constexpr,
                       LIMIT: tl.constexpr, HAS_FLAGS: tl.constexpr, L: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    grp = h // REP
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    pm = offs_p < P
    nm = offs_n < N
    start = tl.load(cu_ptr + b)
    n = tl.load(cu_ptr + b + 1) - start
    chunk0 = tl.load(coff_ptr + b)  # this segment's first chunk in the CB scratch
    slot = tl.load(slot_ptr + b).to(tl.int64)
    sp = state_ptr + slot * stride_ss + h * stride_sh + offs_p[:, None] * stride_sp + offs_n[None, :] * stride_sn
    sm = pm[:, None] & nm[None, :]
    s = tl.load(sp, mask=sm, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    if HAS_FLAGS:
        s = tl.where(tl.load(has_ptr + b) != 0, s, 0.0)
    a_h = tl.load(a_ptr + h).to(tl.float32)
    rows = tl.arange(0, L)
    causal = rows[:, None] >= rows[None, :]
    for c0 in range(0, n, L):
        tm = (c0 + rows) < n
        tok = start + c0 + rows
        dt = tl.load(dt_ptr + tok * stride_dtt + h, mask=tm, other=0.0).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dt_bias_ptr + h).to(tl.float32)
        if SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)  # torch's threshold 20
        if LIMIT:
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        dt = tl.where(tm, dt, 0.0)  # past the segment's end: no decay, no input
        a = dt * a_h
        a_cum = _cumsum(a, 0)
        x = tl.load(x_ptr + tok[:, None] * stride_xt + h * stride_xh + offs_p[None, :],
                    mask=tm[:, None] & pm[None, :], other=0.0).to(tl.float32)  # [L, BLOCK_P]
        xd = x * dt[:, None]
        bc_mask = tm[:, None] & nm[None, :]
        bv = tl.load(b_ptr + tok[:, None] * stride_bt + grp * stride_bg + offs_n[None, :], mask=bc_mask,
                     other=0.0).to(tl.float32)  # [L, BLOCK_N]
        cv = tl.load(c_ptr + tok[:, None] * stride_ct + grp * stride_cg + offs_n[None, :], mask=bc_mask,
                     other=0.0).to(tl.float32)
        cid = (chunk0 + c0 // L).to(tl.int64)
        cb = tl.load(cb_ptr + cid * stride_cbc + grp * stride_cbg + rows[:, None] * L + rows[None, :])
        decay = tl.where(causal, tl.exp(tl.where(causal, a_cum[:, None] - a_cum[None, :], 0.0)), 0.0)
        y = _dot(cb * decay, xd) + _dot(cv, tl.trans(s)) * tl.exp(a_cum)[:, None]  # [L, BLOCK_P]
        if HAS_D:
            y += tl.load(d_ptr + h).to(tl.float32) * x
        tl.store(y_ptr + tok[:, None] * stride_yt + h * stride_yh + offs_p[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=tm[:, None] & pm[None, :])
        a_last = _sum(a, 0)
        s = s * tl.exp(a_last) + _dot(tl.trans(xd * tl.exp(a_last - a_cum)[:, None]), bv)
    tl.store(sp, s.to(state_ptr.dtype.element_ty), mask=sm)


# --- causal conv1d ----------------------------------------------------------------------------


@triton.jit
def conv1d_varlen_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, state_ptr, cu_ptr, cseg_ptr, cfirst_ptr, slot_ptr, has_ptr,
                         C, stride_xt, stride_wc, stride_yt, stride_ss, stride_sc, stride_sk,
                         KW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, HAS_FLAGS: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_K: tl.constexpr):
    cid = tl.program_id(0)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = offs_c < C
    seg = tl.load(cseg_ptr + cid)
    first = tl.load(cfirst_ptr + cid)
    start = tl.load(cu_ptr + seg)
    n = tl.load(cu_ptr + seg + 1) - start
    slot = tl.load(slot_ptr + seg).to(tl.int64)
    # only a segment's first block reads (src < 0 below) and then writes its slot; masks combine blocks
    # only (the interpreter mistypes a block mask & a scalar bool), a scalar flag goes through tl.where
    first_block = (tl.zeros([BLOCK_K], dtype=tl.int64) + first) == 0
    has = True
    if HAS_FLAGS:
        has = tl.load(has_ptr + seg) != 0
    sp = state_ptr + slot * stride_ss + offs_c[None, :] * stride_sc  # [1, BLOCK_C]
    offs_t = first + tl.arange(0, BLOCK_T)  # token index in the segment
    tm = offs_t < n
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW):
        src = offs_t - (KW - 1) + j  # < 0: column KW - 1 + src of the old state
        xv = tl.load(x_ptr + (start + src)[:, None] * stride_xt + offs_c[None, :],
                     mask=(tm & (src >= 0))[:, None] & cm[None, :], other=0.0).to(tl.float32)
        sv = tl.load(sp + (KW - 1 + src)[:, None] * stride_sk,
                     mask=(tm & (src < 0))[:, None] & cm[None, :], other=0.0).to(tl.float32)
        sv = tl.where(has, sv, 0.0)  # a fresh slot's contents are never used (NaN there stays out)
        wj = tl.load(w_ptr + offs_c * stride_wc + j, mask=cm, other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=cm, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + (start + offs_t)[:, None] * stride_yt + offs_c[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=tm[:, None] & cm[None, :])
    # the new state: the segment's last KW - 1 inputs of old state | x, oldest first (first block only)
    offs_m = tl.arange(0, BLOCK_K)
    tau = n - (KW - 1) + offs_m  # token index in the segment of new column m
    mm = (offs_m < KW - 1) & first_block
    xs = tl.load(x_ptr + (start + tau)[:, None] * stride_xt + offs_c[None, :],
                 mask=(mm & (tau >= 0))[:, None] & cm[None, :], other=0.0)
    ss = tl.load(sp + (KW - 1 + tau)[:, None] * stride_sk, mask=(mm & (tau < 0))[:, None] & cm[None, :],
                 other=0.0)
    new = xs.to(tl.float32) + tl.where(has, ss.to(tl.float32), 0.0)  # [BLOCK_K, BLOCK_C]
    tl.debug_barrier()  # every read of the old state above happens before any write below
    tl.store(sp + offs_m[:, None] * stride_sk, new.to(state_ptr.dtype.element_ty), mask=mm[:, None] & cm[None, :])


# --- host side ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SegmentTable:
    """A batch's segments as the kernels index them, on the device (one host-to-device copy)."""

    cu: torch.Tensor  # int64 [B + 1] token offsets
    has: torch.Tensor  # int32 [B] has_state
    chunk_seg: torch.Tensor  # int64 [n_chunks] the segment of each chunk (all segments' chunks in order)
    chunk_first: torch.Tensor  # int64 [n_chunks] the chunk's first token in its segment
    chunk_off: torch.Tensor  # int64 [B] each segment's first chunk
    n_chunks: int
    max_len: int


@functools.lru_cache(maxsize=32)
def _table(seq_lens: tuple[int, ...], has: tuple[bool, ...] | None, chunk: int, device: torch.device) -> SegmentTable:
    cu, seg, first, off = [0], [], [], []
    for i, n in enumerate(seq_lens):
        off.append(len(seg))
        cu.append(cu[-1] + n)
        for f in range(0, n, chunk):
            seg.append(i)
            first.append(f)
    flags = [int(h) for h in has] if has is not None else [1] * len(seq_lens)
    packed = torch.tensor(cu + flags + seg + first + off, dtype=torch.int64).to(device)
    b, nc = len(seq_lens), len(seg)
    parts = torch.split(packed, [b + 1, b, nc, nc, b])
    return SegmentTable(cu=parts[0], has=parts[1].to(torch.int32), chunk_seg=parts[2], chunk_first=parts[3],
                        chunk_off=parts[4], n_chunks=nc, max_len=max(seq_lens))


def segment_table(seq_lens: Sequence[int], has_state: Sequence[bool] | None, chunk: int,
                  device: torch.device | str) -> SegmentTable:
    """The device-side index of a batch (cached: every layer of a forward asks for the same one)."""
    if not seq_lens:
        raise ValueError("no segments")
    if any(int(n) < 1 for n in seq_lens):
        raise ValueError(f"segments must have at least one token each, got lengths {list(seq_lens)}")
    if has_state is not None and len(has_state) != len(seq_lens):
        raise ValueError(f"{len(has_state)} has_state flags for {len(seq_lens)} segments")
    has = tuple(bool(h) for h in has_state) if has_state is not None else None
    return _table(tuple(int(n) for n in seq_lens), has, chunk, torch.device(device))


def _check(inputs: Sequence[torch.Tensor], seq_lens: Sequence[int], slots: torch.Tensor) -> list[torch.Tensor]:
    """The packed inputs, each with a unit last-dim stride (copied only where it has not: a column slice
    of a projection keeps its row stride and is not copied)."""
    total = sum(seq_lens)
    if any(t.shape[0] != total for t in inputs):
        raise ValueError(f"packed inputs have {[t.shape[0] for t in inputs]} rows, segments {total} tokens")
    if len(slots) != len(seq_lens):
        raise ValueError(f"{len(slots)} slots for {len(seq_lens)} segments")
    return [t if t.stride(-1) == 1 else t.contiguous() for t in inputs]


def _block(n: int, cap: int | None = None) -> int:
    """A power-of-two tile at least 16 (tl.dot's minimum) covering n, at most cap (then n is looped/blocked)."""
    b = max(16, triton.next_power_of_2(n))
    return min(b, cap) if cap is not None else b


def _pow2_chunk(chunk_size: int) -> int:
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"the Triton chunk size must be a power of two >= 16, got {chunk_size}")
    return chunk_size


def conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, seq_lens: Sequence[int],
                   slots: torch.Tensor, states: torch.Tensor, has_state: Sequence[bool] | None = None,
                   activation: str | None = "silu", *, block_t: int = 64, block_c: int = 32) -> torch.Tensor:
    """x [sum(seq_lens), C] packed, weight [C, K], bias [C] | None, slots [B], states [slots, C, K-1]
    (in place) -> y [sum(seq_lens), C] in x's dtype."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"conv1d activation {activation!r} is not one this engine runs (silu or None)")
    (x,) = _check([x], seq_lens, slots)
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    c, kw = weight.shape
    block_k = triton.next_power_of_2(kw)
    if block_t < block_k or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= {block_k} (the kernel width), got {block_t}")
    tab = segment_table(seq_lens, has_state, block_t, x.device)
    y = torch.empty_like(x)
    grid = (tab.n_chunks, triton.cdiv(c, block_c))
    conv1d_varlen_kernel[grid](
        x, weight, bias if bias is not None else weight, y, states, tab.cu, tab.chunk_seg, tab.chunk_first, slots,
        tab.has, c, x.stride(0), weight.stride(0), y.stride(0), states.stride(0), states.stride(1), states.stride(2),
        KW=kw, HAS_BIAS=bias is not None, SILU=activation is not None, HAS_FLAGS=has_state is not None,
        BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_K=block_k)
    return y


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                seq_lens: Sequence[int], slots: torch.Tensor, states: torch.Tensor,
                has_state: Sequence[bool] | None = None, *, use_qk_l2norm: bool = True, scale: float | None = None,
                chunk_size: int = 64, block_v: int = 32) -> torch.Tensor:
    """q, k [T, H_k, d_k], v [T, H_v, d_v], g, beta [T, H_v] packed (T = sum(seq_lens)), slots [B],
    states [slots, H_v, d_k, d_v] (in place) -> o [T, H_v, d_v] in v's dtype."""
    q, k, v, g, beta = _check([q, k, v, g, beta], seq_lens, slots)
    _, hk, dk = k.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"{hv} value heads do not group over {hk} key heads")
    chunk = _pow2_chunk(chunk_size)
    tab = segment_table(seq_lens, has_state, chunk, v.device)
    o = torch.empty_like(v)
    bv = _block(dv, max(16, block_v))
    grid = (len(seq_lens), hv, triton.cdiv(dv, bv))
    gdn_chunked_kernel[grid](
        q, k, v, g, beta, o, states, tab.cu, slots, tab.has, dk, dv, scale if scale is not None else dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        o.stride(0), o.stride(1), states.stride(0), states.stride(1), states.stride(2), states.stride(3),
        GROUP=hv // hk, L2NORM=use_qk_l2norm, HAS_FLAGS=has_state is not None, CH=chunk,
        BLOCK_K=_block(dk), BLOCK_V=bv, num_warps=8)
    return o


def ssd_prefill(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
                seq_lens: Sequence[int], slots: torch.Tensor, states: torch.Tensor,
                has_state: Sequence[bool] | None = None, *, D: torch.Tensor | None = None,  # noqa: N803
                dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                dt_limit: tuple[float, float] = NO_LIMIT, chunk_size: int = 64, block_p: int = 32) -> torch.Tensor:
    """x [T, H, P], dt [T, H] (raw), A, D, dt_bias [H], B, C [T, G, N] packed (T = sum(seq_lens)), slots
    [B], states [slots, H, P, N] (in place) -> y [T, H, P] in x's dtype. `chunk_size` is this kernel's
    (see the module docstring), not the model's."""
    x, dt, B, C = _check([x, dt, B, C], seq_lens, slots)  # noqa: N806
    _, nh, hp = x.shape
    ng, ns = B.shape[1:]
    if nh % ng:
        raise ValueError(f"{nh} heads do not group over {ng} B/C groups")
    chunk = _pow2_chunk(chunk_size)
    tab = segment_table(seq_lens, has_state, chunk, x.device)
    cb = torch.empty(tab.n_chunks, ng, chunk, chunk, dtype=torch.float32, device=x.device)
    block_n = _block(ns)
    ssd_cb_kernel[(tab.n_chunks, ng)](
        B, C, cb, tab.cu, tab.chunk_seg, tab.chunk_first, ns,
        B.stride(0), B.stride(1), C.stride(0), C.stride(1), cb.stride(0), cb.stride(1), L=chunk, BLOCK_N=block_n,
        num_warps=8)
    y = torch.empty_like(x)
    bp = _block(hp, max(16, block_p))
    limit = tuple(dt_limit) != NO_LIMIT
    ssd_chunked_kernel[(len(seq_lens), nh, triton.cdiv(hp, bp))](
        x, dt, A, B, C, D if D is not None else A, dt_bias if dt_bias is not None else A, cb, y, states,
        tab.cu, tab.chunk_off, slots, tab.has, hp, ns, float(dt_limit[0]), float(dt_limit[1]) if limit else 0.0,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        cb.stride(0), cb.stride(1), y.stride(0), y.stride(1),
        states.stride(0), states.stride(1), states.stride(2), states.stride(3),
        REP=nh // ng, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None, SOFTPLUS=dt_softplus, LIMIT=limit,
        HAS_FLAGS=has_state is not None, L=chunk, BLOCK_P=bp, BLOCK_N=block_n, num_warps=8)
    return y
