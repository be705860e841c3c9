"""Triton attention backend over the paged KV pool (GPU default; CPU under TRITON_INTERPRET=1).

Dispatch: a batch whose requests all have q_len == 1 goes to the split-K decode kernel, anything
else (prefill chunks, mixed chunked prefill) to the causal extend kernel. Both read K/V only from
the pool; the new tokens' K/V must already be written there (contract in base.py).

FP8 KV pages (uint8 rows [P, ps, Hkv, D + 4]: codes, then a float32 scale; engine/kv_fp8.py) go to the
same kernels as a codes view and a scales view (KV_FP8): they dequantize each block in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from engine import kv_fp8
from engine.attention import triton_kernels as kern
from engine.attention.base import AttentionMetadata

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TritonAttentionConfig:
    """Tile sizes. Defaults suit an H100/H200; tests shrink them to exercise block edges."""

    extend_block_m: int = 64
    extend_block_n: int = 64
    decode_block_n: int = 64
    max_decode_splits: int = 16
    target_programs: int = 264  # decode splits grow until B * Hkv * splits reaches this (2x SMs)
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("extend_block_m", "extend_block_n", "decode_block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.max_decode_splits < 1:
            raise ValueError("max_decode_splits must be >= 1")
        if self.target_programs < 1 or self.num_warps < 1:
            raise ValueError("target_programs and num_warps must be >= 1")


def decode_splits(batch: int, kv_heads: int, max_seq_len: int, cfg: TritonAttentionConfig) -> int:
    """Split the keys only while the grid is too small to fill the GPU, and never below a block."""
    want = triton.cdiv(cfg.target_programs, max(1, batch * kv_heads))
    blocks = triton.cdiv(max(1, max_seq_len), cfg.decode_block_n)
    return max(1, min(want, blocks, cfg.max_decode_splits))


class TritonAttention:
    name = "triton"

    def __init__(self, cfg: TritonAttentionConfig | None = None) -> None:
        self.cfg = cfg or TritonAttentionConfig()

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttentionMetadata,
        window: int = 0,
    ) -> torch.Tensor:
        # q: [T, Hq, D]; k_pages, v_pages: [P, page_size, Hkv, D] (strided layer views; FP8: uint8 [..., D + 4])
        _check_inputs(q, k_pages, v_pages, meta)
        out = torch.empty((q.shape[0], q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        if q.shape[0] == 0:
            return out
        scales = _scales(k_pages, v_pages)
        if kv_fp8.is_fp8(k_pages):
            d = q.shape[2]
            k_pages, v_pages = k_pages[..., :d], v_pages[..., :d]  # the codes (uint8, bitcast in the kernel)
        if meta.max_q_len == 1 and all(n == 1 for n in meta.q_lens_list):
            self._decode(q, k_pages, v_pages, meta, out, window, scales)
        else:
            self._extend(q, k_pages, v_pages, meta, out, window, scales)
        return out  # [T, Hq, D]

    def _decode(self, q, k_pages, v_pages, meta: AttentionMetadata, out: torch.Tensor, window: int,
                scales: tuple) -> None:
        cfg = self.cfg
        batch, hq, d = len(meta.seq_lens_list), q.shape[1], q.shape[2]
        hkv = k_pages.shape[2]
        group = hq // hkv
        visible = min(meta.max_seq_len, window) if window > 0 else meta.max_seq_len
        splits = decode_splits(batch, hkv, visible, cfg)
        if splits == 1:
            # stage 1 writes the final rows: row b of out is request b (q_starts == arange here)
            mid, lse = out, out
            sm = (out.stride(0), out.stride(1), 0)
            sl = (0, 0)
        else:
            mid = torch.empty((batch, hq, splits, d), dtype=torch.float32, device=q.device)
            lse = torch.empty((batch, hq, splits), dtype=torch.float32, device=q.device)
            sm = (mid.stride(0), mid.stride(1), mid.stride(2))
            sl = (lse.stride(0), lse.stride(1))
        block_d = triton.next_power_of_2(d)
        fp8 = kv_fp8.is_fp8(k_pages)
        kern.decode_stage1_kernel[(batch, hkv, splits)](
            q, k_pages, v_pages, meta.page_table, meta.seq_lens, meta.q_starts, mid, lse,
            meta.scale * kern.LOG2E, window,
            *q.stride(), *k_pages.stride(), *v_pages.stride(), *scales, meta.page_table.stride(0),
            *sm, *sl,
            HEAD_DIM=d, GROUP=group, PAGE_SIZE=meta.page_size,
            BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=cfg.decode_block_n,
            BLOCK_D=block_d, NUM_SPLITS=splits, DOT_PRECISION=_precision(q), UPCAST=_upcast(q),
            KV_FP8=fp8, num_warps=cfg.num_warps * (2 if fp8 else 1),  # FP8 at 4 warps spills on sm_90 (d 128)
            num_stages=2 if fp8 and q.dtype == torch.float32 else 3,
        )
        if splits > 1:
            kern.decode_stage2_kernel[(batch, hq)](
                mid, lse, out, meta.q_starts, *sm, *sl, out.stride(0), out.stride(1),
                HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=splits,
                BLOCK_S=triton.next_power_of_2(splits), num_warps=cfg.num_warps,
            )

    def _extend(self, q, k_pages, v_pages, meta: AttentionMetadata, out: torch.Tensor, window: int,
                scales: tuple) -> None:
        cfg = self.cfg
        batch, hq, d = len(meta.seq_lens_list), q.shape[1], q.shape[2]
        group = hq // k_pages.shape[2]
        grid = (batch, hq, triton.cdiv(meta.max_q_len, cfg.extend_block_m))
        block_d = triton.next_power_of_2(d)
        # fp32 (IEEE dots on the FMA units) spilled registers at the half-precision tile (sm_90, 64 x 64 x
        # 4 warps: ~6 KiB of stack per thread): 8 warps and fewer keys per block, 0 spills
        # (tests/unit/triton/test_sm90_compile.py)
        block_n, warps = cfg.extend_block_n, cfg.num_warps
        if q.element_size() == 4:
            block_n, warps = min(block_n, 16 if block_d >= 128 else 32), max(warps, 8)
        kern.extend_kernel[grid](
            q, k_pages, v_pages, out, meta.page_table, meta.seq_lens, meta.q_lens, meta.q_starts,
            meta.scale * kern.LOG2E, window,
            *q.stride(), *k_pages.stride(), *v_pages.stride(), *scales, meta.page_table.stride(0),
            out.stride(0), out.stride(1),
            HEAD_DIM=d, GROUP=group, PAGE_SIZE=meta.page_size,
            BLOCK_M=cfg.extend_block_m, BLOCK_N=block_n,
            BLOCK_D=block_d, DOT_PRECISION=_precision(q), UPCAST=_upcast(q), KV_FP8=kv_fp8.is_fp8(k_pages),
            num_warps=warps, num_stages=2,
        )


def _scales(k_pages: torch.Tensor, v_pages: torch.Tensor) -> tuple:
    """The kernels' scale arguments: (ks_ptr, vs_ptr, 3 strides each) of FP8 rows' float32 scales
    [P, ps, Hkv]; for plain pages the pages themselves and zero strides (never read)."""
    if not kv_fp8.is_fp8(k_pages):
        return (k_pages, v_pages, 0, 0, 0, 0, 0, 0)
    ks, vs = kv_fp8.split(k_pages)[1], kv_fp8.split(v_pages)[1]
    return (ks, vs, *ks.stride(), *vs.stride())


def _upcast(q: torch.Tensor) -> bool:
    # CPU tensors only run under the interpreter, whose tl.dot is wrong for bf16: dot in fp32 there
    return q.device.type == "cpu" and q.dtype != torch.float32


def _precision(q: torch.Tensor) -> str:
    # fp32 (and upcast) operands must not silently drop to TF32 on the GPU; half types ignore this
    return "ieee" if q.dtype == torch.float32 or _upcast(q) else "tf32"


def _check_inputs(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttentionMetadata
) -> None:
    if q.dim() != 3 or k_pages.dim() != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(
            f"expected q [T, Hq, D] and k/v pages [P, page_size, Hkv, D], got {tuple(q.shape)}, "
            f"{tuple(k_pages.shape)}, {tuple(v_pages.shape)}"
        )
    fp8 = kv_fp8.is_fp8(k_pages) and kv_fp8.is_fp8(v_pages)  # FP8 KV rows: uint8 [..., D + 4]
    if q.dtype not in _SUPPORTED or not fp8 and (k_pages.dtype != q.dtype or v_pages.dtype != q.dtype):
        raise ValueError(f"q/k/v dtypes must match and be fp32/fp16/bf16 (or FP8 KV rows, uint8), got {q.dtype}, "
                         f"{k_pages.dtype}, {v_pages.dtype}")
    hq, hkv, d = q.shape[1], k_pages.shape[2], q.shape[2]
    if kv_fp8.row_dim(k_pages) != d or hq % hkv:
        raise ValueError(f"head dims differ or {hq} query heads not a multiple of {hkv} KV heads")
    if k_pages.shape[1] != meta.page_size:
        raise ValueError(f"pool page size {k_pages.shape[1]} != metadata page size {meta.page_size}")
    if d < 16:
        raise ValueError(f"head_dim must be >= 16 for the Triton kernels, got {d}")
