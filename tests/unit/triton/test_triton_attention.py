"""Triton paged-attention kernels vs the torch reference (interpreter on CPU, compiled on CUDA).

The pool has the real layout `[num_pages, num_layers, 2, page_size, Hkv, D]` and the kernels get the
strided layer views `pool[:, l, 0]` / `pool[:, l, 1]`; pages are handed out shuffled so a request's
pages are not contiguous, and q is a strided slice of a fused qkv tensor.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.base import build_metadata
from engine.attention.registry import create_backend
from engine.attention.torch_ref import TorchAttention
from engine.attention.triton_backend import TritonAttention, TritonAttentionConfig, decode_splits

# small tiles: several key blocks, query blocks and decode splits even at these tiny lengths
SMALL = TritonAttentionConfig(extend_block_m=16, extend_block_n=16, decode_block_n=16,
                              target_programs=10_000, max_decode_splits=4)
KV_HEADS = 2
LAYER = 1


def make_case(seq_lens, q_lens, page_size, group, head_dim, dtype, device, seed=0):
    """Random pool + shuffled page tables -> (q, k_pages, v_pages, meta)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [(s + page_size - 1) // page_size for s in seq_lens]
    num_pages = sum(need) + 3  # page 0 reserved, plus spare pages left unused
    pool = torch.randn((num_pages, 2, 2, page_size, KV_HEADS, head_dim), generator=gen)
    pool = pool.to(device=device, dtype=dtype)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    tables = []
    for n in need:
        tables.append(free[:n])
        free = free[n:]
    hq = KV_HEADS * group
    qkv = torch.randn((sum(q_lens), (hq + 2 * KV_HEADS) * head_dim), generator=gen)
    q = qkv.to(device=device, dtype=dtype)[:, : hq * head_dim].view(-1, hq, head_dim)  # strided rows
    meta = build_metadata(tables, list(seq_lens), list(q_lens), page_size, head_dim**-0.5, device)
    return q, pool[:, LAYER, 0], pool[:, LAYER, 1], meta


def check(seq_lens, q_lens, page_size, group, device, cfg=SMALL, head_dim=32,
          dtype=torch.float32, atol=1e-4):
    q, k, v, meta = make_case(seq_lens, q_lens, page_size, group, head_dim, dtype, device)
    assert not k.is_contiguous() and not q.is_contiguous()
    got = TritonAttention(cfg).forward(q, k, v, meta)
    want = TorchAttention().forward(q.float(), k.float(), v.float(), meta)
    assert got.shape == q.shape and got.dtype == dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_decode_ragged(page_size, group, device):
    # ragged lengths: 1 token, mid-page ends, exact page boundary, several split blocks
    check([1, 9, 16, 45], [1, 1, 1, 1], page_size, group, device)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3])
def test_extend_ragged_prefix(page_size, group, device):
    # no prefix; prefix ending mid-page (25 cached, 10 new); a decode-like row mixed in;
    # prefix on a page boundary (16 cached, 21 new: two query blocks)
    check([7, 35, 12, 37], [7, 10, 1, 21], page_size, group, device)


@pytest.mark.parametrize("head_dim", [32, 128])
def test_extend_long_prompt_default_tiles(head_dim, device):
    check([100, 3], [100, 3], 16, 3, device, cfg=TritonAttentionConfig(), head_dim=head_dim)


def test_decode_single_split_writes_output_directly(device):
    cfg = TritonAttentionConfig(decode_block_n=16, target_programs=1)
    assert decode_splits(3, KV_HEADS, 40, cfg) == 1
    check([40, 5, 17], [1, 1, 1], 16, 3, device, cfg=cfg)


def test_head_dim_not_power_of_two(device):
    check([20, 33], [1, 1], 16, 3, device, head_dim=40)
    check([20, 33], [6, 33], 16, 3, device, head_dim=40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    check([30, 19], [1, 1], 16, 3, device, dtype=dtype, atol=2e-2)
    check([30, 19], [11, 19], 16, 3, device, dtype=dtype, atol=2e-2)


def test_decode_splits_policy():
    cfg = TritonAttentionConfig(decode_block_n=64, target_programs=264, max_decode_splits=16)
    assert decode_splits(64, 8, 4096, cfg) == 1  # grid already fills the GPU
    assert decode_splits(1, 3, 4096, cfg) == 16  # few requests: cap
    assert decode_splits(1, 3, 100, cfg) == 2  # never more splits than key blocks
    with pytest.raises(ValueError):
        TritonAttentionConfig(extend_block_m=24)


def test_factory_and_bad_inputs(device):
    backend = create_backend("triton")
    assert backend.name == "triton"
    q, k, v, meta = make_case([5], [1], 16, 1, 32, torch.float32, device)
    with pytest.raises(ValueError, match="dtypes"):
        backend.forward(q.double(), k, v, meta)
    with pytest.raises(ValueError, match="multiple"):
        backend.forward(q[:, :1].expand(-1, 3, -1), k, v, meta)
    with pytest.raises(ValueError, match="page size"):
        backend.forward(q, k[:, :8], v[:, :8], meta)
