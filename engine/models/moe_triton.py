"""Fused mixture-of-experts on the GPU: Triton grouped GEMMs over token blocks sorted by expert.

Shapes: T tokens, H hidden, I per-expert intermediate, E experts, k = top_k, S = T * k routed slots
(slot s = token s // k, its j-th expert is ids.view(-1)[s]).

1. `align_block_size` (torch ops, no host sync): the S slots sorted by expert, each expert's run
   padded to a multiple of BLOCK_M with the sentinel S; `block_expert[b]` is block b's expert. The
   padded length is bounded by S + E * (BLOCK_M - 1) (the grid's size; blocks past the used ones
   have only sentinels and store nothing).
2. gate/up GEMM (`moe_gemm_kernel`, GATED): a program takes one block of BLOCK_M slots of one expert
   and BLOCK_N intermediate columns, multiplies the slots' token rows x[s // k] by that expert's
   gate and up columns, and stores silu(gate) * up into mid [S, I] at the slot's row.
3. down GEMM (same kernel, not GATED, A rows = slots): mid @ w2[e]^T times the routing weight of the
   slot, stored into y [S, H]; then y.view(T, k, H).sum(1).

fp32 uses IEEE dots (no TF32) so results match the CPU path; under TRITON_INTERPRET=1 (CPU tensors)
bf16/fp16 operands are upcast before the dots (the interpreter's numpy has no bf16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def moe_gemm_kernel(
    a_ptr, b_ptr, c_ptr, sorted_ptr, block_expert_ptr, weight_ptr,
    num_slots, N, K, A_DIV,  # A row of slot s = s // A_DIV (k for gate/up, 1 for down)
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    GATED: tl.constexpr, APPLY_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(sorted_ptr + offs_m)  # [BM] int64; num_slots = padding
    valid = slot < num_slots
    row = tl.where(valid, slot // A_DIV, 0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert * stride_be
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + row[:, None] * stride_am + offs_k[None, :] * stride_ak,
                    mask=valid[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_base + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk,
                    mask=b_mask, other=0.0)  # [BK, BN]: gate (or down) columns
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED:  # up rows follow the N gate rows
            bu = tl.load(b_base + (offs_n[None, :] + N) * stride_bn + offs_k[:, None] * stride_bk,
                         mask=b_mask, other=0.0)
            if UPCAST:
                bu = bu.to(tl.float32)
            acc_up = tl.dot(a, bu, acc_up, input_precision=DOT_PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up  # silu(gate) * up
    if APPLY_WEIGHT:
        w = tl.load(weight_ptr + slot, mask=valid, other=0.0)
        acc = acc * w[:, None]
    c = c_ptr + slot[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (sorted slots int64 [P], block_expert int64 [P // block_m]), P = S +
    E * (block_m - 1) rounded up to block_m. Each expert's slots are contiguous, in slot order, start
    at a multiple of block_m and are followed by the sentinel S up to the next multiple."""
    flat = ids.reshape(-1)
    s = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)
    pad_start = pad_end - padded
    order = torch.argsort(flat, stable=True)  # slots by expert
    experts = flat.index_select(0, order)
    run_start = torch.cumsum(counts, 0) - counts
    rank = torch.arange(s, device=flat.device) - run_start.index_select(0, experts)
    total = triton.cdiv(s + num_experts * (block_m - 1), block_m) * block_m
    sorted_slots = torch.full((total,), s, dtype=torch.int64, device=flat.device)
    sorted_slots.index_put_((pad_start.index_select(0, experts) + rank,), order)
    block_first = torch.arange(0, total, block_m, device=flat.device)
    block_expert = torch.searchsorted(pad_end, block_first, right=True).clamp_(max=num_experts - 1)
    return sorted_slots, block_expert


def _block_m(slots: int, num_experts: int) -> int:
    """Rows per block: small blocks when each expert sees few tokens (decode), larger for prefill."""
    per_expert = slots / num_experts
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, sorted_slots: torch.Tensor,
          block_expert: torch.Tensor, weight: torch.Tensor, a_div: int, gated: bool, block_m: int) -> None:
    """c[s] = (silu(gate) * up if gated else a[s] @ b[e]^T * weight[s]) for every routed slot s."""
    n = c.shape[1]
    k = a.shape[1]
    upcast = a.device.type == "cpu" and a.dtype != torch.float32
    precision = "ieee" if a.dtype == torch.float32 or upcast else "tf32"
    grid = (block_expert.numel(), triton.cdiv(n, 64))
    moe_gemm_kernel[grid](
        a, b, c, sorted_slots, block_expert, weight,
        weight.numel(), n, k, a_div,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        GATED=gated, APPLY_WEIGHT=not gated, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32,
        DOT_PRECISION=precision, UPCAST=upcast,
    )


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, inter: int, block_m: int = 0) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) -> [T, H] in x's dtype; x [T, H], w13 [E, 2I, H]
    (gate rows then up rows), w2 [E, H, I], weights fp32 [T, k], ids int64 [T, k]. block_m 0: chosen
    from the slots per expert."""
    t, h = x.shape
    top_k = ids.shape[1]
    num_experts = w13.shape[0]
    if w13.shape[1] != 2 * inter or w2.shape[1:] != (h, inter):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match H={h}, I={inter}")
    slots = t * top_k
    block_m = block_m or _block_m(slots, num_experts)
    sorted_slots, block_expert = align_block_size(ids, num_experts, block_m)
    flat_w = weights.reshape(-1).float().contiguous()  # [S]
    mid = torch.empty((slots, inter), dtype=x.dtype, device=x.device)
    _gemm(x, w13, mid, sorted_slots, block_expert, flat_w, top_k, True, block_m)
    y = torch.empty((slots, h), dtype=x.dtype, device=x.device)
    _gemm(mid, w2, y, sorted_slots, block_expert, flat_w, 1, False, block_m)
    return y.view(t, top_k, h).sum(dim=1)
