"""KV head gather/scatter between a TP group's ranks and the transfer's full wire page (engine/distributed/tp_kv.py):
the pure head math on tensors, then the collectives in real gloo process groups (2 ranks splitting 4
heads, 4 ranks replicating 2 heads)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket

import pytest
import torch

from engine.distributed.tp import TPGroup
from engine.distributed.tp_kv import assemble, from_wire, gather_pages, head_slices, scatter_pages, split_heads, to_wire

L, PS, D, PAGES = 2, 4, 8, 10


def _full_pool(heads: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(PAGES, L, 2, PS, heads, D, generator=g)  # [P, L, 2, ps, H, D]


@pytest.mark.parametrize(("heads", "size", "want"), [
    (4, 1, [(0, 4)]), (4, 2, [(0, 2), (2, 2)]), (4, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]), (1, 2, [(0, 1), (0, 1)]),
])
def test_head_slices_split_or_replicate(heads: int, size: int, want: list) -> None:
    assert head_slices(heads, size) == want


def test_head_slices_pool_with_every_head_on_every_rank() -> None:
    assert head_slices(4, 2, pool_heads=4) == [(0, 4), (0, 4)]


def test_head_slices_refuse_an_uneven_split_naming_the_field() -> None:
    with pytest.raises(ValueError, match="num_key_value_heads"):
        head_slices(6, 4)


@pytest.mark.parametrize(("heads", "size"), [(4, 2), (4, 4), (2, 4), (1, 2), (4, 1)])
def test_split_then_assemble_is_the_identity(heads: int, size: int) -> None:
    full = _full_pool(heads, 1)[:3]
    slices = head_slices(heads, size)
    parts = split_heads(full, slices)
    assert all(p.is_contiguous() and p.shape[4] == c for p, (_, c) in zip(parts, slices))
    assert torch.equal(assemble(parts, slices, heads), full)


def test_assemble_takes_a_replicated_head_from_its_first_holder() -> None:
    full = _full_pool(2, 2)[:2]
    slices = head_slices(2, 4)  # ranks 0,1 hold head 0; ranks 2,3 hold head 1
    parts = split_heads(full, slices)
    parts[1] = torch.full_like(parts[1], 7.0)  # a wrong replica is never read
    parts[3] = torch.full_like(parts[3], 7.0)
    assert torch.equal(assemble(parts, slices, 2), full)


def test_assemble_names_missing_heads() -> None:
    full = _full_pool(4, 3)[:1]
    parts = split_heads(full, [(0, 2), (0, 2)])
    with pytest.raises(ValueError, match=r"\[2, 3\]"):
        assemble(parts, [(0, 2), (0, 2)], 4)


def test_wire_round_trip_shares_storage() -> None:
    full = _full_pool(2, 4)[:3].contiguous()
    wire = to_wire(full)
    assert wire.dtype == torch.uint8 and tuple(wire.shape) == (3, L * 2 * PS * 2 * D * 4)
    back = from_wire(wire, (L, 2, PS, 2, D), torch.float32)
    assert back.data_ptr() == full.data_ptr() and torch.equal(back, full)


def test_single_rank_gather_and_scatter_are_plain_copies() -> None:
    pool = _full_pool(2, 5)
    got = gather_pages(pool, TPGroup(), 2, [4, 1])
    assert torch.equal(got, to_wire(pool[[4, 1]]))
    new = _full_pool(2, 6)[:2]
    scatter_pages(pool, TPGroup(), 2, [7, 3], to_wire(new.clone()))
    assert torch.equal(pool[[7, 3]], new)


def _rank(rank: int, size: int, heads: int, port: int, errors: mp.Queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        tp = TPGroup(rank=rank, size=size)
        first, count = tp.kv_heads(heads)
        full = _full_pool(heads, 10)
        pool = full[:, :, :, :, first:first + count].contiguous()  # this rank's heads only
        got = gather_pages(pool, tp, heads, [3, 1, 5])
        if rank == 0:
            assert torch.equal(got, to_wire(full[[3, 1, 5]].contiguous())), "gather differs"
        else:
            assert got is None
        new = _full_pool(heads, 11)[:2]
        scatter_pages(pool, tp, heads, [6, 2], to_wire(new.clone()) if rank == 0 else None)
        assert torch.equal(pool[[6, 2]], new[:, :, :, :, first:first + count]), f"rank {rank} scatter differs"
        assert torch.equal(pool[0], full[0, :, :, :, first:first + count]), "another page changed"
        dist.destroy_process_group()
    except BaseException as e:  # reported to the test, which fails naming the rank
        errors.put(f"rank {rank}: {e!r}")
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(("size", "heads"), [(2, 4), (4, 2)])
def test_gloo_gather_and_scatter_move_each_ranks_heads(size: int, heads: int) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, heads, port, errors)) for r in range(size)]
    env = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env
    for p in procs:
        p.join(60)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not alive, f"ranks still running after 60 s: {alive}"
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not failures and all(p.exitcode == 0 for p in procs), (failures, [p.exitcode for p in procs])
