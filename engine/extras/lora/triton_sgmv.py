"""Segmented gather matmul (SGMV, Punica/S-LoRA) on the GPU: every adapter of a batch in one launch pair.

Shapes: T tokens, IN/OUT the linear's input/output size, S slots, R the slot stacks' rank width
(--max-lora-rank times the fused parts, zero-padded), G segments: runs of consecutive rows under one
slot (`start`, `length`, `slot`: int32 [G]; base-model rows are in no segment and get nothing).

1. shrink (`sgmv_shrink_kernel`): a program takes BLOCK_M rows of one segment and every rank column:
   v[rows] = x[rows] @ A[slot]^T, A [S, R, IN], accumulated in fp32 over IN in BLOCK_K steps; v [T, R]
   fp32 scratch.
2. expand (`sgmv_expand_kernel`): a program takes BLOCK_M rows of one segment and BLOCK_N outputs:
   out[rows, n] += v[rows] @ B[slot][n]^T, B [S, OUT, R] (scaling folded in), read-add-write in out's dtype.

The grid's second axis covers the longest segment (`max_len`, known on the host: no sync); programs past
their segment's end return at once. fp32 uses IEEE dots (no TF32) so results match the CPU path; under
TRITON_INTERPRET=1 (CPU tensors) bf16/fp16 operands are upcast before the dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def sgmv_shrink_kernel(
    x_ptr, a_ptr, v_ptr, start_ptr, len_ptr, slot_ptr, K, R,
    stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_vm, stride_vr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    g = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    seg_len = tl.load(len_ptr + g)
    if m0 >= seg_len:
        return
    rows = (tl.load(start_ptr + g) + m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = m0 + tl.arange(0, BLOCK_M) < seg_len
    a_base = a_ptr + tl.load(slot_ptr + g).to(tl.int64) * stride_as
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                        mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
            a = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BK, BR] = A[slot]^T
            if UPCAST:
                x = x.to(tl.float32)
                a = a.to(tl.float32)
            acc = tl.dot(x, a, acc, input_precision=DOT_PRECISION)
        tl.store(v_ptr + rows[:, None] * stride_vm + offs_r[None, :] * stride_vr, acc,
                 mask=valid[:, None] & r_mask[None, :])


@triton.jit
def sgmv_expand_kernel(
    v_ptr, b_ptr, out_ptr, start_ptr, len_ptr, slot_ptr, N, R,
    stride_vm, stride_vr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    g = tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    seg_len = tl.load(len_ptr + g)
    if m0 >= seg_len:
        return
    rows = (tl.load(start_ptr + g) + m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = m0 + tl.arange(0, BLOCK_M) < seg_len
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + tl.load(slot_ptr + g).to(tl.int64) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        v = tl.load(v_ptr + rows[:, None] * stride_vm + offs_r[None, :] * stride_vr,
                    mask=valid[:, None] & r_mask[None, :], other=0.0)  # [BM, BR] fp32
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BR, BN] = B[slot]^T
        b = b.to(tl.float32)
        acc = tl.dot(v, b, acc, input_precision=DOT_PRECISION)
    o = out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = valid[:, None] & n_mask[None, :]
    prev = tl.load(o, mask=mask, other=0.0).to(tl.float32)
    tl.store(o, (prev + acc).to(out_ptr.dtype.element_ty), mask=mask)


def sgmv(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, start: torch.Tensor,
         length: torch.Tensor, slot: torch.Tensor, max_len: int) -> torch.Tensor:
    """out [T, OUT] += x[rows] A[slot]^T B[slot]^T for each segment's rows (in place; returns out).
    x [T, IN]; a [S, R, IN]; b [S, OUT, R]; start/length/slot int32 [G]; max_len = max(length)."""
    t, k = x.shape
    r, n = a.shape[1], out.shape[1]
    if a.shape[2] != k or b.shape[1] != n or b.shape[2] != r:
        raise ValueError(f"sgmv: x {tuple(x.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)}, out "
                         f"{tuple(out.shape)} do not match")
    groups = start.numel()
    if not groups or not max_len:
        return out
    upcast = x.device.type == "cpu" and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    v = torch.empty((t, r), dtype=torch.float32, device=x.device)
    bm, br = 16, 16
    m_blocks = triton.cdiv(max_len, bm)
    sgmv_shrink_kernel[(groups, m_blocks)](
        x, a, v, start, length, slot, k, r,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), v.stride(0), v.stride(1),
        BLOCK_M=bm, BLOCK_R=br, BLOCK_K=32, DOT_PRECISION=precision, UPCAST=upcast)
    sgmv_expand_kernel[(groups, m_blocks, triton.cdiv(n, 64))](
        v, b, out, start, length, slot, n, r,
        v.stride(0), v.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_N=64, BLOCK_R=br, DOT_PRECISION=precision, UPCAST=upcast)
    return out
