"""Sliding-window attention in both backends: the torch reference against a dense softmax written
out here, the Triton kernels against the reference, and pages wholly before every query's window
replaced by page 0 (as if released) without changing a result."""

from __future__ import annotations

import pytest
import torch
from test_triton_attention import SMALL, make_case

from engine.attention.torch_ref import TorchAttention, gather_kv
from engine.attention.triton_backend import TritonAttention


def dense_reference(q, k_pages, v_pages, meta, window: int) -> torch.Tensor:
    """One query at a time: softmax over keys max(0, p-W+1)..p of its request, in float64."""
    out = torch.empty_like(q, dtype=torch.float64)
    group = q.shape[1] // k_pages.shape[2]
    row = 0
    for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.q_lens_list)):
        k = gather_kv(k_pages, meta.page_table[b], seq_len).double().repeat_interleave(group, 1)  # [S, Hq, D]
        v = gather_kv(v_pages, meta.page_table[b], seq_len).double().repeat_interleave(group, 1)
        for i in range(q_len):
            p = seq_len - q_len + i
            lo = max(0, p - window + 1) if window else 0
            s = torch.einsum("hd,shd->hs", q[row].double(), k[lo : p + 1]) * meta.scale
            out[row] = torch.einsum("hs,shd->hd", s.softmax(-1), v[lo : p + 1])
            row += 1
    return out


def release_before_window(meta, window: int, page_size: int) -> None:
    """Zero the page-table entries of pages no query of the request can see (page 0 is reserved)."""
    for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.q_lens_list)):
        first_visible = max(0, seq_len - q_len - window + 1)
        meta.page_table[b, : first_visible // page_size] = 0


CASES = [  # (seq_lens, q_lens): decode rows, prefixes longer than the window, mid-page ends, mixed
    ([1, 9, 40, 77], [1, 1, 1, 1]),
    ([7, 35, 12, 70], [7, 10, 1, 21]),
    ([100, 3], [100, 3]),
]


@pytest.mark.parametrize("window", [1, 8, 20])
@pytest.mark.parametrize("seq_lens,q_lens", CASES)
def test_torch_reference_matches_dense_window(seq_lens, q_lens, window):
    q, k, v, meta = make_case(seq_lens, q_lens, 16, 3, 32, torch.float32, "cpu")
    got = TorchAttention().forward(q, k, v, meta, window)
    torch.testing.assert_close(got.double(), dense_reference(q, k, v, meta, window), atol=1e-5, rtol=1e-5)
    full = TorchAttention().forward(q, k, v, meta)
    assert (got - full).abs().max() > 1e-3  # the window changes something in these cases


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("window", [8, 20])
@pytest.mark.parametrize("seq_lens,q_lens", CASES)
def test_triton_window_matches_reference_with_released_pages(seq_lens, q_lens, window, page_size, device):
    q, k, v, meta = make_case(seq_lens, q_lens, page_size, 3, 32, torch.float32, device)
    want = TorchAttention().forward(q.cpu().float(), k.cpu().float(), v.cpu().float(), _cpu(meta), window)
    release_before_window(meta, window, page_size)
    got = TritonAttention(SMALL).forward(q, k, v, meta, window)
    torch.testing.assert_close(got.float().cpu(), want, atol=1e-4, rtol=1e-4)
    again = TorchAttention().forward(q.cpu().float(), k.cpu().float(), v.cpu().float(), _cpu(meta), window)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=1e-5)  # the reference never reads them either


def _cpu(meta):
    from dataclasses import replace

    return replace(meta, page_table=meta.page_table.cpu(), seq_lens=meta.seq_lens.cpu(),
                   q_lens=meta.q_lens.cpu(), q_starts=meta.q_starts.cpu())
