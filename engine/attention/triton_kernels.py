"""Triton kernels for attention over the paged KV pool (contract: engine/attention/base.py).

Two kernels, both reading every key and value straight from the pool through the page table:

Both run the same online-softmax step per block of keys (`_softmax_step`, which the MLA decode kernel
shares); they differ in the rows a program owns and in which keys each row sees.

- decode: one query per request. Grid (B, Hkv, num_splits): a program takes the GROUP query heads
  that share one KV head (padded to BLOCK_H rows so `tl.dot` applies) and one slice of the
  request's keys, runs an online softmax over BLOCK_N-key blocks and writes a normalized partial
  output plus its log-sum-exp (base 2). A second kernel merges the splits. With one split the first
  kernel writes the final output directly and the merge is skipped.
- extend: q_len new tokens per request. Grid (B, Hq, cdiv(max_q_len, BLOCK_M)): a program takes
  BLOCK_M queries of one head, loops over keys 0..(last visible position) in BLOCK_N blocks with the
  causal mask `key_pos <= seq_len - q_len + i`, online softmax in fp32.

Sliding window (WINDOW > 0 tokens): a query at position p sees keys p-WINDOW+1..p. Both kernels start
their key loop at the first block any of their queries can see (keys before it are never loaded, so
their pages may be released) and mask the rest.

Pool views are strided (`pool[:, layer, 0]` of `[num_pages, num_layers, 2, page_size, H, D]`): every
stride is passed explicitly and page ids are widened to int64 before they scale a stride. Head dims
that are not a power of two are padded to BLOCK_D and masked. Scores use exp2 with the scale folded
into log2(e). fp32 inputs use IEEE dot products (no TF32) so results match the torch reference.
UPCAST (set for CPU tensors, i.e. under TRITON_INTERPRET=1) converts q/k/v to fp32 before the dots:
the interpreter's `tl.dot` mishandles bf16 operands (numpy has no bf16).

KV_FP8 (`--kv-cache-dtype fp8_e4m3`, engine/kv_fp8.py): k_ptr/v_ptr point at the uint8 codes of the
packed rows and ks_ptr/vs_ptr at their float32 scales (one per token and KV head, their own strides);
a block is loaded as bytes, bitcast to float8e4nv, widened and scaled in registers, then converted to
q's dtype for the dots: the pool is never dequantized in memory. Without it ks_ptr/vs_ptr are unused.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
# finite "minus infinity": fully masked rows stay NaN-free; a constexpr, as a plain global does not
# compile for a GPU (the interpreter accepts either)
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _load_kv_block(
    ptr, page_row_ptr, offs_n, n_mask, kvh, offs_d, d_mask,
    stride_p, stride_s, stride_h, stride_d, PAGE_SIZE: tl.constexpr,
):
    """Gather keys (or values) at cache positions offs_n -> [BLOCK_N, BLOCK_D] as stored (FP8: uint8 codes)."""
    page = tl.load(page_row_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = (offs_n % PAGE_SIZE).to(tl.int64)
    addr = (
        ptr + page[:, None] * stride_p + slot[:, None] * stride_s + kvh * stride_h
        + offs_d[None, :] * stride_d
    )
    return tl.load(addr, mask=n_mask[:, None] & d_mask[None, :], other=0)


@triton.jit
def _load_row_scale(
    scale_ptr, page_row_ptr, offs_n, n_mask, kvh, stride_sp, stride_ss, stride_sh, PAGE_SIZE: tl.constexpr,
):
    """KV_FP8: the float32 scales of the rows at cache positions offs_n -> [BLOCK_N] (0 outside n_mask)."""
    page = tl.load(page_row_ptr + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = (offs_n % PAGE_SIZE).to(tl.int64)
    return tl.load(scale_ptr + page * stride_sp + slot * stride_ss + kvh * stride_sh, mask=n_mask, other=0.0)


@triton.jit
def _softmax_step(s, v, acc, m_i, l_i, visible, DOT_PRECISION: tl.constexpr):
    """One block of keys of the online softmax every attention kernel runs (base 2, fp32 statistics;
    engine/attention/mla_triton.py too).

    s [R, BLOCK_N]: scores already scaled by scale * log2(e), for R query rows (a decode's heads, an
    extend's queries); v [BLOCK_N, Dv]: the block's values; visible [R or 1, BLOCK_N]: the keys each row
    may see; acc [R, Dv], m_i and l_i [R]: running output, max and sum -> the updated (acc, m_i, l_i).
    A row that has seen no key yet adds nothing (its max is still NEG_BIG)."""
    return _softmax_step_scaled(s, v, acc, m_i, l_i, visible, 1.0, DOT_PRECISION, False)


@triton.jit
def _softmax_step_scaled(s, v, acc, m_i, l_i, visible, v_scale, DOT_PRECISION: tl.constexpr, V_SCALED: tl.constexpr):
    """`_softmax_step` with each value row scaled (V_SCALED: v_scale [BLOCK_N], FP8 rows' scales): the
    probabilities are scaled per key before P.V, equal to dequantizing v first (one multiply per key)."""
    s = tl.where(visible, s, NEG_BIG)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_SCALED:
        p = p * v_scale[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_block(
    q, acc, m_i, l_i, visible, k_ptr, v_ptr, page_row, offs_n, n_mask, kvh, offs_d, d_mask, qk_scale,
    stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
    ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    PAGE_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    """The paged kernels' step over keys and values at cache positions offs_n [BLOCK_N] (n_mask: inside
    the loop's range): gather both from the pool, score q [R, BLOCK_D], then `_softmax_step`.
    KV_FP8: the codes widen exactly to q's dtype (e4m3 fits bf16/fp16/fp32) and the rows' scales are
    applied per key after the dots (scores, and the probabilities before P.V): no fp32 tile of K or V."""
    k = _load_kv_block(k_ptr, page_row, offs_n, n_mask, kvh, offs_d, d_mask,
                       stride_kp, stride_ks, stride_kh, stride_kd, PAGE_SIZE)
    v = _load_kv_block(v_ptr, page_row, offs_n, n_mask, kvh, offs_d, d_mask,
                       stride_vp, stride_vs, stride_vh, stride_vd, PAGE_SIZE)
    if KV_FP8:
        k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [R, BLOCK_N]
    v_scale = 1.0
    if KV_FP8:
        s = s * _load_row_scale(ks_ptr, page_row, offs_n, n_mask, kvh, stride_ksp, stride_kss, stride_ksh,
                                PAGE_SIZE)[None, :]
        v_scale = _load_row_scale(vs_ptr, page_row, offs_n, n_mask, kvh, stride_vsp, stride_vss, stride_vsh,
                                  PAGE_SIZE)
    return _softmax_step_scaled(s, v, acc, m_i, l_i, visible, v_scale, DOT_PRECISION, KV_FP8)


@triton.jit
def decode_stage1_kernel(
    q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, q_starts_ptr, mid_ptr, lse_ptr,
    qk_scale,  # scale * log2(e)
    window,  # sliding window in tokens, 0 = none
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    ks_ptr, vs_ptr,  # KV_FP8: float32 scales [P, page_size, Hkv] of the K and V rows
    stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    stride_pt,
    stride_mb, stride_mh, stride_ms,  # mid: [B, Hq, NUM_SPLITS, D] (or out with stride_ms = 0)
    stride_lb, stride_lh,  # lse: [B, Hq, NUM_SPLITS]
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    q_row = tl.load(q_starts_ptr + b).to(tl.int64)
    # each split owns a BLOCK_N-aligned slice of the visible keys first..seq_len-1
    first = tl.maximum(seq_len - window, 0) if window > 0 else 0
    per_split = tl.cdiv(tl.cdiv(seq_len - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h  # [BLOCK_H] query heads of this KV head
    q = tl.load(
        q_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=h_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    page_row = page_table_ptr + b.to(tl.int64) * stride_pt

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + offs_n0
        n_mask = offs_n < hi
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, n_mask[None, :], k_ptr, v_ptr, page_row, offs_n, n_mask, kvh, offs_d, d_mask,
            qk_scale, stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
            PAGE_SIZE, DOT_PRECISION, UPCAST, KV_FP8,
        )  # acc [BLOCK_H, BLOCK_D]

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    mid = (
        mid_ptr + b.to(tl.int64) * stride_mb + heads[:, None] * stride_mh + split * stride_ms
        + offs_d[None, :]
    )
    tl.store(mid, out.to(mid_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), NEG_BIG)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def decode_stage2_kernel(
    mid_ptr, lse_ptr, out_ptr, q_starts_ptr,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Merge the splits of one (request, head): weights 2^(lse_s - max lse)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=NEG_BIG)
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(s_mask, w, 0.0)  # [BLOCK_S]
    mid = tl.load(
        mid_ptr + b.to(tl.int64) * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :], other=0.0,
    ).to(tl.float32)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(mid * w[:, None], 0) / tl.sum(w, 0)
    row = tl.load(q_starts_ptr + b).to(tl.int64)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=d_mask)


@triton.jit
def extend_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, page_table_ptr, seq_lens_ptr, q_lens_ptr, q_starts_ptr,
    qk_scale,  # scale * log2(e)
    window,  # sliding window in tokens, 0 = none
    stride_qt, stride_qh, stride_qd,
    stride_kp, stride_ks, stride_kh, stride_kd,
    stride_vp, stride_vs, stride_vh, stride_vd,
    ks_ptr, vs_ptr,  # KV_FP8: float32 scales [P, page_size, Hkv] of the K and V rows
    stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
    stride_pt, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + b)
    if mblk * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    q_row0 = tl.load(q_starts_ptr + b).to(tl.int64)
    prefix = seq_len - q_len
    kvh = h // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n0 = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    rows = q_row0 + offs_m.to(tl.int64)
    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m  # absolute positions of these queries
    page_row = page_table_ptr + b.to(tl.int64) * stride_pt
    end = tl.minimum(seq_len, prefix + (mblk + 1) * BLOCK_M)  # keys past the last query are unseen
    begin = 0
    if window > 0:  # the block's first query sees nothing before its window: start at that block
        begin = (tl.maximum(prefix + mblk * BLOCK_M - window + 1, 0) // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        offs_n = start + offs_n0
        n_mask = offs_n < end
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])  # [BLOCK_M, BLOCK_N]
        if window > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _attend_block(
            q, acc, m_i, l_i, visible, k_ptr, v_ptr, page_row, offs_n, n_mask, kvh, offs_d, d_mask,
            qk_scale, stride_kp, stride_ks, stride_kh, stride_kd, stride_vp, stride_vs, stride_vh, stride_vd,
            ks_ptr, vs_ptr, stride_ksp, stride_kss, stride_ksh, stride_vsp, stride_vss, stride_vsh,
            PAGE_SIZE, DOT_PRECISION, UPCAST, KV_FP8,
        )  # acc [BLOCK_M, BLOCK_D]

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :],
    )
