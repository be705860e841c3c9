"""Staged transfer of a TP > 1 side (real zmq control plane, the in-process fake data backend, which
hands the bytes over): a prefill whose rank-0 pool holds half the heads sends gathered full pages
(`send(data=)`), a staged decode receives each message into a buffer of full pages it hands over
(`create_receiver(staged=True)`, `landed()`),
and the compatibility record lets TP differ but names any other difference (412)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from transfer import CompatInfo, ErrorCode, KVPoll, TransferConfig, TransferManager

HEADS, L, PS, D = 2, 1, 4, 8


def compat(tp: int = 1, heads: int = HEADS) -> CompatInfo:
    return CompatInfo("m", "float32", PS, "page_major", L, heads, D, tp=tp)


def pool(heads: int, n: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, L, 2, PS, heads, D, generator=g)  # [pages, layers, 2, page_size, heads, dim]


def pump(mgrs: list[TransferManager], cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        for m in mgrs:
            m.progress()
        mgrs[0].idle_wait(0.002)


def wire(full: torch.Tensor) -> torch.Tensor:
    return full.contiguous().reshape(full.shape[0], -1).view(torch.uint8)  # uint8 [n, page_bytes]


@pytest.fixture
def managers():
    made: list[TransferManager] = []

    def make(role: str, kv: torch.Tensor, info: CompatInfo) -> TransferManager:
        port = {"bootstrap_port": 0} if role == "prefill" else {}
        m = TransferManager(TransferConfig(role=role, backend="fake", **port), kv, info)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_compat_page_bytes_and_tp_is_servable() -> None:
    assert compat().page_bytes == L * 2 * PS * HEADS * D * 4
    assert compat(tp=2).digest() == compat(tp=4).digest()
    assert compat(tp=2).mismatch(compat(tp=1).to_dict()) is None
    assert "num_kv_heads" in compat(tp=2).mismatch(compat(heads=4).to_dict())
    with pytest.raises(ValueError, match="tp"):
        compat(tp=0)


def test_prefill_sends_gathered_pages_to_a_tp1_decode(managers) -> None:
    full_p = pool(HEADS, seed=1)  # what the prefill's ranks hold together
    p = managers("prefill", full_p[..., :1, :].contiguous(), compat(tp=2))  # rank 0: head 0 only
    d_pool = torch.zeros(16, L, 2, PS, HEADS, D)
    d = managers("decode", d_pool, compat(tp=1))
    assert p.wire_page_bytes == d.page_bytes == 2 * p.page_bytes
    s = p.create_sender(5)
    r = d.create_receiver(5, f"127.0.0.1:{p.bootstrap_port}", [9, 3, 4])
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    s.send([2, 7], False, data=wire(full_p[[2, 7]]))
    s.send([8], True, {"room": 5}, data=wire(full_p[[8]]))
    pump([p, d], lambda: r.poll() == KVPoll.SUCCESS and s.poll() == KVPoll.SUCCESS)
    assert torch.equal(d_pool[[9, 3, 4]], full_p[[2, 7, 8]])
    assert d_pool[[0, 1, 2, 5]].abs().sum() == 0  # nothing else written


def test_staged_decode_hands_over_landed_full_pages(managers) -> None:
    p_pool = pool(HEADS, seed=2)
    p = managers("prefill", p_pool, compat(tp=1))
    d_shard = torch.zeros(16, L, 2, PS, 1, D)  # a TP=2 decode's rank 0: head 0 only
    d = managers("decode", d_shard, compat(tp=2))
    s = p.create_sender(6)
    r = d.create_receiver(6, f"127.0.0.1:{p.bootstrap_port}", [11, 4, 5], staged=True)
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    s.send([1], False)
    pump([p, d], lambda: d.stats().staging_bytes > 0)
    first = r.landed()
    assert [pages for pages, _ in first] == [[11]] and r.landed() == []
    s.send([2, 3], True, {"room": 6})
    pump([p, d], lambda: r.poll() == KVPoll.SUCCESS and s.poll() == KVPoll.SUCCESS)
    rest = r.landed()  # the last pages are there once the room succeeded
    got = {pg: buf[i] for pages, buf in first + rest for i, pg in enumerate(pages)}
    assert sorted(got) == [4, 5, 11]
    for src, dst in ((1, 11), (2, 4), (3, 5)):
        assert torch.equal(got[dst], wire(p_pool[[src]])[0]), (src, dst)
    assert d_shard.abs().sum() == 0  # the pool is the caller's to fill (engine/distributed/tp_kv.py scatter)


def test_a_failed_staged_room_hands_over_nothing(managers) -> None:
    p = managers("prefill", pool(HEADS), compat(tp=1))
    d = managers("decode", pool(1), compat(tp=2))
    s = p.create_sender(7)
    r = d.create_receiver(7, f"127.0.0.1:{p.bootstrap_port}", [1, 2], staged=True)
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    s.send([3], False)
    pump([p, d], lambda: d.stats().staging_bytes > 0)
    r.abort("client went away")
    assert r.landed() == [] and d.stats().staging_bytes == 0
    pump([p, d], lambda: s.poll() == KVPoll.FAILED)


def test_bad_data_shape_is_refused(managers) -> None:
    p = managers("prefill", pool(1), compat(tp=2))
    d = managers("decode", pool(1), compat(tp=2))
    s = p.create_sender(2)
    d.create_receiver(2, f"127.0.0.1:{p.bootstrap_port}", [1], staged=True)
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    with pytest.raises(ValueError, match="data must be"):
        s.send([3], True, data=torch.zeros(2, p.wire_page_bytes, dtype=torch.uint8))


def test_other_head_count_is_refused_with_412_naming_the_field(managers) -> None:
    p = managers("prefill", pool(1), compat(tp=2))
    d = managers("decode", pool(4), compat(tp=1, heads=4))
    s = p.create_sender(3)
    r = d.create_receiver(3, f"127.0.0.1:{p.bootstrap_port}", [1])
    pump([p, d], lambda: r.poll() == KVPoll.FAILED and s.poll() == KVPoll.FAILED)
    assert r.error.code == s.error.code == ErrorCode.INCOMPATIBLE == 412
    assert "num_kv_heads" in r.error.message
