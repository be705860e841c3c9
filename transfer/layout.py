"""KV pool as pages of bytes, and how a chunk's pages are cut into UCX messages.

kv_pool: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], page-major and contiguous,
so page p is one block of `page_bytes` bytes and a run of consecutive pages is one contiguous region.
The transfer layer only sees `page_view(pool)`: uint8 [num_pages, page_bytes].

A chunk maps source pages onto destination positions (a cursor into the decode's dst_pages).
`plan_segments` cuts it into messages ("segments"):
- a direct segment: a run where source AND destination pages are both consecutive and the run has
  at least `direct_min_bytes`; it is sent from the source pool and received into the destination
  pool with no copy;
- staged segments: the remaining short runs, gathered (index_select) into one staging buffer of at
  most `stage_max_bytes` on the sender; the receiver receives into the destination pool directly if
  those destination pages happen to be consecutive, else into a staging buffer it then scatters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DIRECT_MIN_BYTES = 256 << 10  # a run this large is one message without copies
STAGE_MAX_BYTES = 8 << 20  # cap of one gathered message


def page_view(kv_pool: torch.Tensor) -> torch.Tensor:
    """kv_pool [num_pages, ...] contiguous -> uint8 [num_pages, page_bytes], sharing storage."""
    if not kv_pool.is_contiguous():
        raise ValueError("kv_pool must be contiguous (page-major layout)")
    if kv_pool.dim() < 1 or kv_pool.shape[0] < 1:
        raise ValueError("kv_pool must have at least one page in dim 0")
    flat = kv_pool.reshape(kv_pool.shape[0], -1)  # [num_pages, elems_per_page]
    return flat.view(torch.uint8)  # [num_pages, page_bytes]


def is_consecutive(pages: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(pages, pages[1:]))


@dataclass(frozen=True)
class Segment:
    positions: list[int]  # indices into the room's dst_pages, ascending
    src_pages: list[int]  # same length: source page of each position

    @property
    def src_direct(self) -> bool:
        return is_consecutive(self.src_pages)


def _pair_runs(src: list[int], dst: list[int], first_pos: int) -> list[tuple[int, int]]:
    """[(start index, length)] of maximal runs where src and dst both step by +1."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[first_pos + i] != dst[first_pos + i - 1] + 1:
            runs.append((start, i - start))
            start = i
    return runs


def plan_segments(src: list[int], dst: list[int], first_pos: int, page_bytes: int,
                  direct_min_bytes: int = DIRECT_MIN_BYTES,
                  stage_max_bytes: int = STAGE_MAX_BYTES) -> list[Segment]:
    """Cut src pages (going to dst[first_pos:first_pos+len(src)]) into segments, in position order."""
    if first_pos + len(src) > len(dst):
        raise ValueError(f"{len(src)} pages from position {first_pos} overflow {len(dst)} dst pages")
    direct: list[Segment] = []
    loose: list[int] = []  # chunk indices left for staging
    for start, n in _pair_runs(src, dst, first_pos):
        if n * page_bytes >= direct_min_bytes:
            direct.append(Segment([first_pos + start + k for k in range(n)], src[start:start + n]))
        else:
            loose.extend(range(start, start + n))
    per_stage = max(1, stage_max_bytes // page_bytes)
    staged = [
        Segment([first_pos + i for i in group], [src[i] for i in group])
        for group in (loose[k:k + per_stage] for k in range(0, len(loose), per_stage))
    ]
    return sorted(direct + staged, key=lambda s: s.positions[0])
