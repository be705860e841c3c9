"""Attention backend interface over the paged KV pool (layout: docs/architecture.md); the backends
themselves are picked by name in engine/attention/registry.py.

A backend computes attention for a batch of requests whose new tokens' K/V are already written to
the pool. Query i of request b sits at absolute position p = seq_lens[b] - q_lens[b] + i and attends
causally to cache positions 0..p, or with a sliding window W > 0 to p-W+1..p only (keys before
the window are never read, so their pages may hold anything). GQA: query head h reads KV head
h // group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    page_table: torch.Tensor  # int32 [B, max_pages], 0-padded
    seq_lens: torch.Tensor  # int32 [B], tokens in cache after this step
    q_lens: torch.Tensor  # int32 [B], new tokens this step
    q_starts: torch.Tensor  # int32 [B], row of each request's first query in q
    scale: float
    # host-side copies for backends that loop in Python (torch reference)
    seq_lens_list: list[int]
    q_lens_list: list[int]
    page_size: int
    max_seq_len: int
    max_q_len: int


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_pages: torch.Tensor,  # [P, page_size, Hkv, D]
        v_pages: torch.Tensor,  # [P, page_size, Hkv, D]
        meta: AttentionMetadata,
        window: int = 0,  # sliding window in tokens; 0 = full causal attention
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


def build_metadata(
    page_tables: list[list[int]], seq_lens: list[int], q_lens: list[int], page_size: int,
    scale: float, device: torch.device | str,
) -> AttentionMetadata:
    """Pack per-request page lists and lengths into the tensors every backend reads."""
    b = len(seq_lens)
    width = max(1, max((len(p) for p in page_tables), default=1))
    table = torch.zeros((b, width), dtype=torch.int32)
    for i, pages in enumerate(page_tables):
        if pages:
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    starts, acc = [], 0
    for n in q_lens:
        starts.append(acc)
        acc += n
    dev = torch.device(device)
    return AttentionMetadata(
        page_table=table.to(dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        q_lens=torch.tensor(q_lens, dtype=torch.int32, device=dev),
        q_starts=torch.tensor(starts, dtype=torch.int32, device=dev),
        scale=scale,
        seq_lens_list=list(seq_lens),
        q_lens_list=list(q_lens),
        page_size=page_size,
        max_seq_len=max(seq_lens, default=0),
        max_q_len=max(q_lens, default=0),
    )


def triton_kernels(backend: str, device: torch.device | str) -> bool:
    """Whether a model's own Triton kernels run (fused MoE, the MLA decode kernel, LoRA's slot stacks and
    SGMV, the recurrent layers' decode steps): always on CUDA, and wherever the attention backend is
    "triton" (on CPU tensors that is Triton's interpreter, TRITON_INTERPRET=1: how CI runs these paths).
    Every other case takes the torch/CPU forms."""
    return torch.device(device).type == "cuda" or backend == "triton"
