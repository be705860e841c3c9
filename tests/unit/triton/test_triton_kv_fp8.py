"""The Triton kernels read FP8 KV pages (`--kv-cache-dtype fp8_e4m3`, engine/kv_fp8.py): paged attention
(decode with splits and the merge, extend, sliding window) and MLA's absorbed decode, each against the torch
reference over the same FP8 pages (interpreter on CPU, compiled on CUDA). Tiny shapes, small tiles, shuffled
pages, strided layer views of a real multi-layer pool."""

from __future__ import annotations

import random

import pytest
import torch

from engine import kv_fp8
from engine.attention.base import build_metadata
from engine.attention.mla import mla_decode_torch
from engine.attention.mla_triton import mla_decode_triton
from engine.attention.torch_ref import TorchAttention
from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig

SMALL = TritonAttentionConfig(extend_block_m=16, extend_block_n=16, decode_block_n=16, target_programs=10_000,
                              max_decode_splits=4)


def _tables(seq_lens: list[int], ps: int, rng: random.Random) -> tuple[int, list[list[int]]]:
    need = [-(-s // ps) for s in seq_lens]
    free = list(range(1, sum(need) + 3))
    rng.shuffle(free)
    tables = []
    for n in need:
        tables.append(free[:n])
        free = free[n:]
    return sum(need) + 3, tables


@pytest.mark.parametrize("q_lens,seq_lens,window,dtype", [
    ((1, 1, 1), (9, 40, 23), 0, torch.float32),  # decode, several splits
    ((1, 1), (50, 17), 12, torch.float32),  # decode, sliding window
    ((7, 20), (7, 45), 0, torch.float32),  # extend over a cached prefix
    ((1, 13), (30, 13), 5, torch.bfloat16),  # mixed, windowed, bf16 queries
])
def test_paged_kernels_read_fp8_pages(q_lens, seq_lens, window, dtype, device) -> None:
    ps, hkv, group, d = 4, 2, 2, 32
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    pages, tables = _tables(list(seq_lens), ps, rng)
    pool = kv_fp8.quantize(torch.randn(pages, 2, 2, ps, hkv, d, generator=gen) * 3).to(device)  # [P, L, 2, ps, H, D+4]
    k, v = pool[:, 1, 0], pool[:, 1, 1]  # strided uint8 layer views
    meta = build_metadata(tables, list(seq_lens), list(q_lens), ps, d**-0.5, device)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen).to(device=device, dtype=dtype)
    got = TritonAttention(SMALL).forward(q, k, v, meta, window)
    want = TorchAttention().forward(q.float(), k, v, meta, window)  # dequantizes the same pages to fp32
    assert got.dtype == dtype and torch.isfinite(got).all()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_kernel_reads_fp8_latents(splits, device) -> None:
    rank, rope, ps, heads = 32, 16, 4, 5
    seq_lens = [9, 30, 17]
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    pages, tables = _tables(seq_lens, ps, rng)
    pool = kv_fp8.quantize(torch.randn(pages, 2, ps, rank + rope, generator=gen)).to(device)  # [P, L, ps, R+Dr+4]
    table = torch.zeros((3, max(len(t) for t in tables)), dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    table, seq = table.to(device), torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q_lat = torch.randn(3, heads, rank, generator=gen).to(device)
    q_pe = torch.randn(3, heads, rope, generator=gen).to(device)
    got = mla_decode_triton(q_lat, q_pe, pool, 1, table, seq, 0.2, rank, block_n=16, num_splits=splits)
    want = mla_decode_torch(q_lat, q_pe, pool, 1, table, seq, 0.2, rank)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
