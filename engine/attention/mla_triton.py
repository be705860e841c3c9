"""Triton MLA decode kernel (absorbed form) over the latent KV pool; oracle: engine/attention/mla.py.

Pool: latent_pool[pages, layers, page_size, kv_lora_rank + rope_dim], one vector per cached token of a
layer: the latent c_kv (R = kv_lora_rank) then the rotated rope key k_pe (Dr = rope_dim). Every query
head reads the same vector, so a program takes BLOCK_H heads of one sequence at once (`tl.dot` needs
16 rows) and loads each latent block once for all of them.

Split-K (flash decoding), two kernels:
1. `mla_decode_stage1_kernel`, grid (B, cdiv(H, BLOCK_H), NUM_SPLITS): a program owns a BLOCK_N-aligned
   slice of the sequence's tokens and walks it in BLOCK_N-token blocks gathered through the page table:
   s = scale * (q_latent . c_kv + q_pe . k_pe)   [BLOCK_H, BLOCK_N]
   with an online softmax (exp2, running max and sum in fp32), acc += p . c_kv  [BLOCK_H, BLOCK_R]
   (the c_kv block serves as key and as value: one load). It writes its normalized partial output and
   log-sum-exp (base 2); with one split it writes the final output and the merge is skipped.
2. `mla_merge_kernel`, grid (B, H): weights 2^(lse_s - max lse) (skipped with one split).

Widths that are not a power of two are padded and masked; page ids are widened to int64 before they
scale a stride. fp32 inputs use IEEE dots (no TF32); fp16/bf16 accumulate in fp32. UPCAST (CPU tensors,
i.e. TRITON_INTERPRET=1) converts operands to fp32 before the dots: the interpreter's `tl.dot` mishandles
bf16.

FP8 latent pool (`--kv-cache-dtype fp8_e4m3`, engine/kv_fp8.py: uint8 rows [R + Dr codes | float32 scale]):
KV_FP8 loads the codes as bytes, bitcasts them to float8e4nv and scales each token's row in registers
(scale_ptr: the float32 scales [pages, page_size]), then the dots run in q's dtype as before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import kv_fp8
from engine.attention.triton_kernels import LOG2E, NEG_BIG, _softmax_step

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
BLOCK_H = 16  # heads per program: tl.dot's minimum row count
TARGET_PROGRAMS = 264  # splits grow until B * head_blocks * splits reaches this (2x H100 SMs)
MAX_SPLITS = 16


@triton.jit(do_not_specialize=["num_heads"])  # one compile for any head count
def mla_decode_stage1_kernel(
    ql_ptr, qpe_ptr, pool_ptr, page_table_ptr, seq_lens_ptr, mid_ptr, lse_ptr,
    qk_scale,  # scale * log2(e)
    num_heads,
    stride_qlt, stride_qlh, stride_qld,
    stride_qpt, stride_qph, stride_qpd,
    stride_pp, stride_ps, stride_pd,  # latent_pool[:, layer]: [pages, page_size, R + Dr]
    scale_ptr, stride_sp, stride_ss,  # KV_FP8: the rows' float32 scales [pages, page_size]
    stride_pt,
    stride_mb, stride_mh, stride_ms,  # mid: [B, H, NUM_SPLITS, R] (or out with stride_ms = 0)
    stride_lb, stride_lh,  # lse: [B, H, NUM_SPLITS]
    RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_PE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    hblk = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_e = tl.arange(0, BLOCK_PE)
    offs_n0 = tl.arange(0, BLOCK_N)
    h_mask = heads < num_heads
    r_mask = offs_r < RANK
    e_mask = offs_e < ROPE
    b64 = b.to(tl.int64)
    q_lat = tl.load(
        ql_ptr + b64 * stride_qlt + heads[:, None] * stride_qlh + offs_r[None, :] * stride_qld,
        mask=h_mask[:, None] & r_mask[None, :], other=0.0,
    )  # [BLOCK_H, BLOCK_R]
    q_pe = tl.load(
        qpe_ptr + b64 * stride_qpt + heads[:, None] * stride_qph + offs_e[None, :] * stride_qpd,
        mask=h_mask[:, None] & e_mask[None, :], other=0.0,
    )  # [BLOCK_H, BLOCK_PE]
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    page_row = page_table_ptr + b64 * stride_pt

    m_i = tl.full([BLOCK_H], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + offs_n0
        n_mask = offs_n < hi
        page = tl.load(page_row + offs_n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = (offs_n % PAGE_SIZE).to(tl.int64)
        row = pool_ptr + page * stride_pp + slot * stride_ps  # [BLOCK_N]
        c_kv = tl.load(row[:, None] + offs_r[None, :] * stride_pd,
                       mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
        k_pe = tl.load(row[:, None] + (RANK + offs_e[None, :]) * stride_pd,
                       mask=n_mask[:, None] & e_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_PE]
        if KV_FP8:  # uint8 codes -> float8e4nv -> fp32 x the token's scale, then q's dtype
            sc = tl.load(scale_ptr + page * stride_sp + slot * stride_ss, mask=n_mask, other=0.0)[:, None]
            c_kv = (c_kv.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(q_lat.dtype)
            k_pe = (k_pe.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc).to(q_pe.dtype)
        if UPCAST:
            c_kv = c_kv.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c_kv), input_precision=DOT_PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        acc, m_i, l_i = _softmax_step(s, c_kv, acc, m_i, l_i, n_mask[None, :], DOT_PRECISION)  # [BLOCK_H, BLOCK_R]

    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    mid = mid_ptr + b64 * stride_mb + heads[:, None] * stride_mh + split * stride_ms + offs_r[None, :]
    tl.store(mid, out.to(mid_ptr.dtype.element_ty), mask=h_mask[:, None] & r_mask[None, :])
    if NUM_SPLITS > 1:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), NEG_BIG)
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=h_mask)


@triton.jit
def mla_merge_kernel(
    mid_ptr, lse_ptr, out_ptr,
    stride_mb, stride_mh, stride_ms, stride_lb, stride_lh, stride_ob, stride_oh,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """Merge the splits of one (sequence, head): out = sum_s 2^(lse_s - max lse) mid_s / sum of weights."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    s_mask = offs_s < NUM_SPLITS
    r_mask = offs_r < RANK
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=NEG_BIG)
    w = tl.where(s_mask, tl.exp2(lse - tl.max(lse, 0)), 0.0)  # [BLOCK_S]
    mid = tl.load(
        mid_ptr + b * stride_mb + h * stride_mh + offs_s[:, None] * stride_ms + offs_r[None, :],
        mask=s_mask[:, None] & r_mask[None, :], other=0.0,
    )  # [BLOCK_S, BLOCK_R] fp32
    out = tl.sum(mid * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_r, out.to(out_ptr.dtype.element_ty), mask=r_mask)


def mla_splits(batch: int, num_heads: int, max_seq_len: int, block_n: int) -> int:
    """Split the tokens only while the grid is too small to fill the GPU, never below one block each."""
    want = triton.cdiv(TARGET_PROGRAMS, max(1, batch * triton.cdiv(num_heads, BLOCK_H)))
    return max(1, min(want, triton.cdiv(max(1, max_seq_len), block_n), MAX_SPLITS))


def mla_decode_triton(q_latent: torch.Tensor, q_pe: torch.Tensor, latent_pool: torch.Tensor, layer: int,
                      page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, kv_lora_rank: int,
                      *, block_n: int = 0, num_splits: int = 0, max_seq_len: int = 0) -> torch.Tensor:
    """Absorbed MLA decode attention; same contract as `engine.attention.mla.mla_decode_torch`.

    q_latent [B, H, R], q_pe [B, H, Dr], latent_pool [pages, layers, page_size, R + Dr] (strided views
    allowed), page_table [B, max_pages] int32, seq_lens [B] int32 >= 1 -> out [B, H, R] in q_latent's
    dtype. Tuning (keyword-only, 0 = automatic): block_n tokens per block (power of two >= 16),
    num_splits KV splits; max_seq_len bounds seq_lens for the split choice (0: the page table's width x
    page size; seq_lens is never read on the host).
    """
    _check(q_latent, q_pe, latent_pool, layer, page_table, seq_lens, kv_lora_rank)
    t, h, r = q_latent.shape
    rope = q_pe.shape[2]
    out = torch.empty((t, h, r), dtype=q_latent.dtype, device=q_latent.device)
    if t == 0:
        return out
    pool = latent_pool[:, layer]  # [pages, page_size, R + Dr] (FP8: uint8 [..., R + Dr + 4])
    fp8 = kv_fp8.is_fp8(pool)
    scales = (pool, 0, 0)  # unused without FP8
    if fp8:
        sc = kv_fp8.split(pool)[1]
        pool, scales = pool[..., : r + rope], (sc, *sc.stride())
    upcast = q_latent.device.type == "cpu" and q_latent.dtype != torch.float32
    precision = "ieee" if q_latent.dtype == torch.float32 or upcast else "tf32"
    block_r = max(16, triton.next_power_of_2(r))
    # sm_90 (ptxas): bf16 at width 512 x 32 tokens, 8 warps: 156 registers, 66 KiB shared; fp32 halves the tile
    block_n = block_n or (16 if q_latent.element_size() == 4 and block_r >= 256 else 32)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    bound = max_seq_len or page_table.shape[1] * pool.shape[1]  # table width x page size: no host sync
    splits = num_splits or mla_splits(t, h, bound, block_n)
    if splits == 1:  # stage 1 writes the final rows
        mid, lse = out, out
        sm, sl = (out.stride(0), out.stride(1), 0), (0, 0)
    else:
        mid = torch.empty((t, h, splits, r), dtype=torch.float32, device=q_latent.device)
        lse = torch.empty((t, h, splits), dtype=torch.float32, device=q_latent.device)
        sm, sl = (mid.stride(0), mid.stride(1), mid.stride(2)), (lse.stride(0), lse.stride(1))
    mla_decode_stage1_kernel[(t, triton.cdiv(h, BLOCK_H), splits)](
        q_latent, q_pe, pool, page_table, seq_lens, mid, lse, scale * LOG2E, h,
        *q_latent.stride(), *q_pe.stride(), *pool.stride(), *scales, page_table.stride(0), *sm, *sl,
        RANK=r, ROPE=rope, PAGE_SIZE=pool.shape[1], BLOCK_H=BLOCK_H, BLOCK_N=block_n, BLOCK_R=block_r,
        BLOCK_PE=max(16, triton.next_power_of_2(rope)), NUM_SPLITS=splits, DOT_PRECISION=precision,
        UPCAST=upcast, KV_FP8=fp8, num_warps=8 if block_r >= 256 else 4, num_stages=2,  # 8 warps: no spills at 512
    )
    if splits > 1:
        mla_merge_kernel[(t, h)](
            mid, lse, out, *sm, *sl, out.stride(0), out.stride(1),
            RANK=r, BLOCK_R=block_r, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )
    return out  # [B, H, R]


def _check(q_latent: torch.Tensor, q_pe: torch.Tensor, latent_pool: torch.Tensor, layer: int,
           page_table: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int) -> None:
    if q_latent.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_latent.shape[:2]:
        raise ValueError(f"q_latent [T, H, R] and q_pe [T, H, Dr] expected, got {tuple(q_latent.shape)}, "
                         f"{tuple(q_pe.shape)}")
    if q_latent.shape[2] != kv_lora_rank:
        raise ValueError(f"q_latent width {q_latent.shape[2]} != kv_lora_rank {kv_lora_rank}")
    if latent_pool.dim() != 4 or kv_fp8.row_dim(latent_pool) != kv_lora_rank + q_pe.shape[2]:
        raise ValueError(f"latent_pool [pages, layers, page_size, {kv_lora_rank} + {q_pe.shape[2]}] expected, "
                         f"got {tuple(latent_pool.shape)}")
    if not 0 <= layer < latent_pool.shape[1]:
        raise ValueError(f"layer {layer} out of range for {latent_pool.shape[1]} layers")
    dt = q_latent.dtype
    if dt not in _SUPPORTED or q_pe.dtype != dt or latent_pool.dtype not in (dt, torch.uint8):
        raise ValueError(f"q_latent/q_pe/latent_pool dtypes must match and be fp32/fp16/bf16 (or FP8 rows, uint8), "
                         f"got {dt}, {q_pe.dtype}, {latent_pool.dtype}")
    if page_table.dim() != 2 or seq_lens.shape != (q_latent.shape[0],) or page_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"page_table [B, max_pages] and seq_lens [B] with B = T = {q_latent.shape[0]} expected, "
                         f"got {tuple(page_table.shape)}, {tuple(seq_lens.shape)}")
    if page_table.dtype not in (torch.int32, torch.int64) or seq_lens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"page_table/seq_lens must be integer tensors, got {page_table.dtype}, {seq_lens.dtype}")
