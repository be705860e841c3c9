"""KV pages between a TP group's ranks and the transfer's wire page (the `kv_gather`/`kv_scatter` rank ops).

A rank's KV pool holds only its KV heads: [num_pages, layers, 2, page_size, h_r, head_dim], h_r from
`TPGroup.kv_heads` (an even share, or one replicated head when the group is larger than the head
count, GQA). The transfer moves the model's canonical page, all heads:
[layers, 2, page_size, num_kv_heads, head_dim] (transfer/config.py: CompatInfo), so any prefill TP
talks to any decode TP and TP=1 <-> TP=1 moves the pool's own pages with no copy.

- `gather_pages` (prefill, TP > 1): every rank hands its heads of the chunk's pages to rank 0, which
  assembles full pages (each head from the first rank that holds it) and returns them as wire bytes,
  uint8 [n, wire page_bytes]. Rank 0 sends from that staging tensor.
- `scatter_pages` (decode, TP > 1): rank 0 holds the received full pages; each rank gets exactly the
  heads it holds (a replicated head goes to every rank holding it) and stores them in its pool at
  the same page ids (rank 0's allocator is the only one: page ids are the same on every rank).

Both are collectives: every rank of the group calls them in the same order, on the worker thread
(`gather(runner, pages)` / `scatter(runner, pages, data)` on rank 0 broadcast the rank ops
`kv_gather` / `kv_scatter` through `runner.collective`, engine/distributed/tp_runner.py), never from the
transfer's progress thread. The page ids travel with the op; the KV itself moves only in the
gather/scatter collectives (rank 0's received pages are never pickled to the other ranks). A pool that
holds every head on every rank (no KV sharding) gathers from rank 0 alone and scatters the full page.

MLA (DeepSeek) latent pools [P, L, ps, kv_lora_rank + rope_dim] are replicated: a TP > 1 prefill sends rank
0's pages as they are (service.pd.gathers_kv is False; no gather), and a TP > 1 decode receives ONE copy
per decode group (the transfer moves it once) and `broadcast_latent`s it from rank 0 to the other ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.distributed.tp import TPGroup
from engine.distributed.tp_ranks import rank_op
from engine.forward.model_runner import ModelRunner

if TYPE_CHECKING:
    from engine.distributed.tp_runner import AnyRunner

_OUTGOING: dict[int, torch.Tensor] = {}  # id(rank 0's pool) -> the pages kv_scatter hands out (never pickled)


def head_slices(num_kv_heads: int, size: int, pool_heads: int | None = None) -> list[tuple[int, int]]:
    """(first, count) of the KV heads each rank 0..size-1 holds. `pool_heads`: the heads a rank's pool
    actually has; equal to num_kv_heads means every rank holds all of them."""
    if pool_heads == num_kv_heads:
        return [(0, num_kv_heads)] * size
    return [TPGroup(rank=r, size=size).kv_heads(num_kv_heads) for r in range(size)]


def assemble(shards: list[torch.Tensor], slices: list[tuple[int, int]], num_kv_heads: int) -> torch.Tensor:
    """Ranks' shards [n, L, 2, ps, h_r, D] -> full pages [n, L, 2, ps, num_kv_heads, D]; each head
    comes from the first rank that holds it. ValueError if some head is held by no rank."""
    n, layers, two, ps, _, dim = shards[0].shape
    full = shards[0].new_empty((n, layers, two, ps, num_kv_heads, dim))
    filled = [False] * num_kv_heads
    for shard, (first, count) in zip(shards, slices):
        if all(filled[first:first + count]):
            continue  # a replica of heads already taken
        full[:, :, :, :, first:first + count] = shard
        filled[first:first + count] = [True] * count
    if not all(filled):
        raise ValueError(f"KV heads {[h for h, f in enumerate(filled) if not f]} are held by no rank")
    return full


def split_heads(full: torch.Tensor, slices: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Full pages [n, L, 2, ps, H, D] -> each rank's heads [n, L, 2, ps, h_r, D], contiguous."""
    return [full[:, :, :, :, first:first + count].contiguous() for first, count in slices]


def to_wire(full: torch.Tensor) -> torch.Tensor:
    """Full pages [n, L, 2, ps, H, D] (contiguous) -> uint8 [n, wire page_bytes], sharing storage."""
    return full.contiguous().reshape(full.shape[0], -1).view(torch.uint8)


def from_wire(data: torch.Tensor, page_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """uint8 [n, wire page_bytes] -> full pages [n, *page_shape] of dtype, sharing storage.
    page_shape: (layers, 2, page_size, num_kv_heads, head_dim)."""
    return data.view(dtype).reshape(data.shape[0], *page_shape)


def gather_pages(pool: torch.Tensor, tp: TPGroup, num_kv_heads: int, pages: list[int]) -> torch.Tensor | None:
    """Collective. pool: this rank's [P, L, 2, ps, h_r, D]. Rank 0 returns the pages' full wire bytes,
    uint8 [len(pages), wire page_bytes]; other ranks return None."""
    idx = torch.tensor(pages, dtype=torch.long, device=pool.device)
    shard = pool.index_select(0, idx)  # [n, L, 2, ps, h_r, D]
    if pool.dim() == 4:  # MLA latent pages [n, L, ps, latent]: the same on every rank, rank 0's are whole
        return to_wire(shard) if tp.driver else None
    slices = head_slices(num_kv_heads, tp.size, pool.shape[4])
    if tp.size == 1 or pool.shape[4] == num_kv_heads:  # rank 0 holds every head
        if tp.size > 1 and not tp.driver:
            return None
        return to_wire(shard)
    shards = [torch.empty_like(shard) for _ in range(tp.size)] if tp.driver else None
    dist.gather(shard, shards, group=tp.group, group_dst=0)
    if not tp.driver:
        return None
    return to_wire(assemble(shards, slices, num_kv_heads))  # type: ignore[arg-type]


def scatter_pages(pool: torch.Tensor, tp: TPGroup, num_kv_heads: int, pages: list[int],
                  data: torch.Tensor | None) -> None:
    """Collective. Rank 0 passes `data`, uint8 [len(pages), wire page_bytes] (full pages); every rank
    stores its heads of them into pool[pages] (pool: [P, L, 2, ps, h_r, D])."""
    if pool.dim() == 4:  # MLA latent pages: one received copy, broadcast to every rank
        broadcast_latent(pool, tp, pages, data)
        return
    n = len(pages)
    local = (n, *pool.shape[1:])  # [n, L, 2, ps, h_r, D]
    slices = head_slices(num_kv_heads, tp.size, pool.shape[4])
    if tp.driver:
        if data is None:
            raise ValueError("rank 0 must pass the received pages to scatter")
        full = from_wire(data, (*pool.shape[1:4], num_kv_heads, pool.shape[5]), pool.dtype)
        parts = split_heads(full, slices)
        mine = parts[0]
    else:
        parts, mine = None, pool.new_empty(local)
    if tp.size > 1:
        dist.scatter(mine, parts, group=tp.group, group_src=0)
    idx = torch.tensor(pages, dtype=torch.long, device=pool.device)
    pool.index_copy_(0, idx, mine)


def broadcast_latent(pool: torch.Tensor, tp: TPGroup, pages: list[int], data: torch.Tensor | None) -> None:
    """Collective (MLA). Rank 0 passes `data`, uint8 [len(pages), wire page_bytes]: latent pages
    [L, ps, kv_lora_rank + rope_dim], which every rank needs whole (the latent is replicated, never sliced
    by head). One broadcast from rank 0 over the group (a node-local copy: the wire carried it once), then
    every rank stores them into pool[pages] (pool: [P, L, ps, latent])."""
    if tp.driver:
        if data is None:
            raise ValueError("rank 0 must pass the received pages to scatter")
        pages_t = from_wire(data, tuple(pool.shape[1:]), pool.dtype).to(pool.device)
    else:
        pages_t = pool.new_empty((len(pages), *pool.shape[1:]))
    if tp.size > 1:
        dist.broadcast(pages_t, group=tp.group, group_src=0)
    pool.index_copy_(0, torch.tensor(pages, dtype=torch.long, device=pool.device), pages_t)


def gather(runner: AnyRunner, pages: list[int]) -> torch.Tensor:
    """Rank 0: the pages' full wire bytes, uint8 [len(pages), wire page_bytes], gathered from every rank."""
    out = runner.collective(_kv_gather, pages=list(pages))
    assert out is not None, "rank 0's kv_gather returns the pages"
    return out


def scatter(runner: AnyRunner, pages: list[int], data: torch.Tensor) -> None:
    """Rank 0: store received full pages (uint8 [len(pages), wire page_bytes]) into every rank's pool
    at `pages`, each rank its own heads."""
    _OUTGOING[id(runner.pool)] = data
    try:
        runner.collective(_kv_scatter, pages=list(pages))
    finally:
        _OUTGOING.pop(id(runner.pool), None)


@rank_op("kv_gather")
def _kv_gather(runner: ModelRunner, pages: list[int]) -> torch.Tensor | None:
    return gather_pages(runner.pool.buffer, runner.tp, runner.model_cfg.num_kv_heads, pages)


@rank_op("kv_scatter")
def _kv_scatter(runner: ModelRunner, pages: list[int]) -> None:
    data = _OUTGOING.get(id(runner.pool)) if runner.tp.driver else None
    scatter_pages(runner.pool.buffer, runner.tp, runner.model_cfg.num_kv_heads, pages, data)
