"""The FP8 KV cache's row format (`--kv-cache-dtype fp8_e4m3`), shared by the pool that writes it
(engine/kvcache/memory.py) and the attention backends that read it (engine/attention/).

One KV row (a token's K or V of one head; an MLA latent) of D values is stored as D + 4 bytes:
D float8_e4m3fn codes, then the row's float32 scale (its 4 bytes, native order), so a pool of these
rows is a plain uint8 tensor whose last dim is D + 4. Value i = float(code[i]) * scale, scale =
max|row| / 448 (per token and head, computed when the row is written: dynamic, nothing to calibrate).
The scale lives inside the page, so every byte-level page move (PD transfer, host tier, disk tier,
retraction, TP gather/scatter, a fork's page copy) carries it with the codes.

Why per token-head rather than vLLM's per-tensor static scale 1.0: on the embedded model the two measured
the same (benchmarks/kv_fp8.py: teacher-forced log-prob 0.012 vs 0.013 nats/token from fp32 KV on one text,
0.010 vs 0.009 on another: its K/V values sit inside e4m3's range); a per-row scale keeps that true for models
whose K/V do not (|x| > 448 clamps at scale 1.0, |x| < 2^-9 flushes) with nothing to calibrate. It costs 4
bytes per row (D=64: 6%).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_BYTES = 4  # one float32 scale after each row's codes
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model's --dtype
_TINY = torch.finfo(torch.float32).tiny


def is_fp8(rows: torch.Tensor) -> bool:
    """Whether `rows` are FP8 KV rows (uint8, D + 4 bytes each) rather than plain values."""
    return rows.dtype == torch.uint8


def row_dim(rows: torch.Tensor) -> int:
    """D, the values of one row (an FP8 row's last dim less its scale bytes)."""
    return rows.shape[-1] - SCALE_BYTES if is_fp8(rows) else rows.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float dtype) -> uint8 [..., D + 4]: the codes, then the float32 scale of each row."""
    xf = x.float()
    scale = (xf.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_min(_TINY)  # [..., 1]; an all-zero row: codes 0
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return torch.cat([codes.view(torch.uint8), scale.view(torch.uint8)], dim=-1)


def split(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 rows [..., D + 4] (strided views allowed) -> (codes float8_e4m3fn [..., D], scales float32 [...]),
    both views of the same storage (D must be a multiple of 4, so the scale is 4-byte aligned)."""
    d = rows.shape[-1] - SCALE_BYTES
    if d % 4:
        raise ValueError(f"FP8 KV rows need a row size divisible by 4, got {d}")
    return rows[..., :d].view(FP8), rows[..., d:].view(torch.float32)[..., 0]


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [..., D + 4] -> values [..., D] in `dtype` (plain rows are only converted)."""
    if not is_fp8(rows):
        return rows.to(dtype)
    d = rows.shape[-1] - SCALE_BYTES
    codes = rows[..., :d].view(FP8)
    scale = rows[..., d:].contiguous().view(torch.float32)  # [..., 1]
    return (codes.float() * scale).to(dtype)


def row_bytes(values: int, kv_cache_dtype: str, itemsize: int) -> int:
    """Bytes of one stored row of `values` values: FP8 codes + scale, else `itemsize` each."""
    return values + SCALE_BYTES if kv_cache_dtype == "fp8_e4m3" else values * itemsize
