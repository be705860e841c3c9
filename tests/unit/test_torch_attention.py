"""The CPU attention backends (engine/attention/torch_ref.py, and cpu_native.py: the native decode
kernel) against dense float64 attention written out here: ragged batches of extends that cross
EXTEND_BLOCK, with and without a cached prefix, sliding windows, GQA, and decode over more keys than
the kernel's block, on pages that are strided views of a pool layer, as the engine's are. The
engine's oracle tests check both end to end against transformers."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.base import build_metadata
from engine.attention.registry import create_backend
from engine.attention.torch_ref import EXTEND_BLOCK, TorchAttention

assert EXTEND_BLOCK < 150  # the first case's 150-token prompt crosses block edges

HQ, HKV, D, PS = 6, 2, 16, 8
LAYERS, LAYER = 3, 1  # pages are layer 1's K/V views of a [P, LAYERS, 2, PS, HKV, D] pool


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, window: int) -> torch.Tensor:
    """q [L, Hq, D] at positions past.., k, v [past+L, Hkv, D] -> [L, Hq, D], in float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    pos_q = torch.arange(past, past + q.shape[0])[:, None]
    pos_k = torch.arange(k.shape[0])[None, :]
    allowed = (pos_k <= pos_q) & ((pos_k > pos_q - window) if window else True)
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def test_cpu_backend_is_the_native_one() -> None:
    """The runner's CPU default builds (cc is on every machine the suite runs on): no silent fallback."""
    assert create_backend("cpu").name == "cpu"


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("shape", [
    [(150, 150), (5, 5)],  # whole prompts: one crosses two block edges
    [(200, 70), (33, 1), (90, 90)],  # a cached prefix of 130 tokens, a decode row, a prompt
    [(1, 1), (9, 1), (64, 1), (300, 1)],  # decode only; 300 keys: the native kernel's blocks of 128
    [(77, 1)],  # one decode row: the native kernel splits it by KV head
])
def test_matches_dense_attention(shape: list[tuple[int, int]], window: int, backend: str) -> None:
    g = torch.Generator().manual_seed(len(shape) + window)
    pages = 1 + sum((s + PS - 1) // PS for s, _ in shape)
    pool = torch.randn(pages, LAYERS, 2, PS, HKV, D, generator=g)
    k_pages, v_pages = pool[:, LAYER, 0], pool[:, LAYER, 1]
    tables, nxt = [], 1  # page 0 stays unused: a wrong page id reads garbage, not a neighbour
    for seq_len, _ in shape:
        n = (seq_len + PS - 1) // PS
        tables.append(list(range(nxt, nxt + n))[::-1])  # pages out of order
        nxt += n
    q = torch.randn(sum(ql for _, ql in shape), HQ, D, generator=g)
    meta = build_metadata(tables, [s for s, _ in shape], [ql for _, ql in shape], PS, 1 / math.sqrt(D), "cpu")
    attn = TorchAttention() if backend == "torch" else create_backend(backend)
    got = attn.forward(q, k_pages, v_pages, meta, window)
    start = 0
    for b, (seq_len, q_len) in enumerate(shape):
        ids = torch.tensor(tables[b])
        k = k_pages[ids].reshape(-1, HKV, D)[:seq_len]
        v = v_pages[ids].reshape(-1, HKV, D)[:seq_len]
        want = _dense(q[start : start + q_len], k, v, seq_len - q_len, window)
        torch.testing.assert_close(got[start : start + q_len].double(), want, rtol=1e-4, atol=1e-5)
        start += q_len
