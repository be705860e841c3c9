"""Lifecycle of rooms over the real zmq control plane with the fake data backend (no bytes)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from transfer import CompatInfo, ErrorCode, KVPoll, TransferConfig, TransferError, TransferManager

COMPAT = CompatInfo("m", "float32", 4, "page_major", 1, 1, 8)


def pool(n: int = 32) -> torch.Tensor:
    return torch.zeros(n, 1, 2, 4, 1, 8)  # [pages, layers, 2, page_size, kv_heads, head_dim]


def pump(mgrs: list[TransferManager], cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        for m in mgrs:
            m.progress()
        mgrs[0].idle_wait(0.002)


def make_pair(**kw) -> tuple[TransferManager, TransferManager, str]:
    p_kw = {k: v for k, v in kw.items() if not k.startswith("d_")}
    d_kw = {k[2:]: v for k, v in kw.items() if k.startswith("d_")}
    d_kw = {**{k: v for k, v in p_kw.items() if k != "bootstrap_port"}, **d_kw}
    p = TransferManager(TransferConfig(role="prefill", backend="fake", bootstrap_port=0, **p_kw),
                        pool(), COMPAT)
    d = TransferManager(TransferConfig(role="decode", backend="fake", **d_kw), pool(), COMPAT)
    return p, d, f"127.0.0.1:{p.bootstrap_port}"


@pytest.fixture
def pair():
    p, d, addr = make_pair()
    yield p, d, addr
    p.close()
    d.close()


def test_full_lifecycle_states_in_order(pair):
    p, d, addr = pair
    s = p.create_sender(7)
    assert s.poll() == KVPoll.BOOTSTRAPPING
    r = d.create_receiver(7, addr, [3, 4, 9, 10])
    assert r.poll() == KVPoll.BOOTSTRAPPING
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT and r.poll() == KVPoll.WAITING_FOR_INPUT)
    assert s.num_dst_pages == 4
    s.send([1, 2], is_last=False)
    assert s.poll() == KVPoll.TRANSFERRING
    pump([p, d], lambda: r.poll() == KVPoll.TRANSFERRING)
    s.send([5, 6], is_last=True, metadata={"first_token": 42, "room": 7})
    pump([p, d], lambda: s.poll() == KVPoll.SUCCESS and r.poll() == KVPoll.SUCCESS)
    assert r.metadata == {"first_token": 42, "room": 7}
    assert s.error is None and r.error is None
    s.release()
    r.release()
    assert p.active_rooms() == 0 and d.active_rooms() == 0
    assert p.stats().pending_sends == 0 and d.stats().pending_recvs == 0


def test_early_transfer_info_is_buffered(pair):
    p, d, addr = pair
    r = d.create_receiver(8, addr, [1])
    pump([p, d], lambda: r.poll() == KVPoll.WAITING_FOR_INPUT)
    assert p.stats().early_infos == 1
    s = p.create_sender(8)
    assert s.poll() == KVPoll.WAITING_FOR_INPUT and s.num_dst_pages == 1
    s.send([2], is_last=True)
    pump([p, d], lambda: r.poll() == KVPoll.SUCCESS and s.poll() == KVPoll.SUCCESS)


def test_duplicate_rooms_rejected(pair):
    p, d, addr = pair
    p.create_sender(1)
    with pytest.raises(TransferError, match="room 1"):
        p.create_sender(1)
    d.create_receiver(2, addr, [1])
    with pytest.raises(TransferError, match="room 2") as e:
        d.create_receiver(2, addr, [2])
    assert e.value.code == ErrorCode.DUPLICATE_ROOM


def test_duplicate_transfer_info_from_second_decode(pair):
    p, d, addr = pair
    d2 = TransferManager(TransferConfig(role="decode", backend="fake"), pool(), COMPAT)
    try:
        s = p.create_sender(3)
        r1 = d.create_receiver(3, addr, [1])
        pump([p, d], lambda: r1.poll() == KVPoll.WAITING_FOR_INPUT)
        r2 = d2.create_receiver(3, addr, [1])
        pump([p, d, d2], lambda: r2.poll() == KVPoll.FAILED)
        assert r2.error.code == ErrorCode.DUPLICATE_ROOM and "room 3" in r2.error.message
        assert s.poll() == KVPoll.WAITING_FOR_INPUT  # the first decode keeps the room
    finally:
        d2.close()


def test_compat_mismatch_names_field(pair):
    p, _, addr = pair
    other = CompatInfo("m", "float32", 4, "page_major", 1, 2, 8)  # num_kv_heads differs
    d2 = TransferManager(TransferConfig(role="decode", backend="fake"), pool(), other)
    try:
        s = p.create_sender(4)
        r = d2.create_receiver(4, addr, [1])
        pump([p, d2], lambda: r.poll() == KVPoll.FAILED and s.poll() == KVPoll.FAILED)
        assert r.error.code == ErrorCode.INCOMPATIBLE
        assert "num_kv_heads" in r.error.message and "num_kv_heads" in s.error.message
    finally:
        d2.close()


@pytest.mark.parametrize("side", ["sender", "receiver"])
def test_abort_propagates(pair, side):
    p, d, addr = pair
    s = p.create_sender(5)
    r = d.create_receiver(5, addr, [1, 2])
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    s.send([3], is_last=False)
    (s if side == "sender" else r).abort("client went away")
    peer = r if side == "sender" else s
    pump([p, d], lambda: peer.poll() == KVPoll.FAILED)
    assert "client went away" in peer.error.message and peer.error.code == ErrorCode.ABORTED
    s.release()
    r.release()
    assert p.active_rooms() == 0 and d.active_rooms() == 0


def test_cluster_token_refused():
    p, d, addr = make_pair(cluster_token="secret", d_cluster_token="wrong")
    try:
        s = p.create_sender(6)
        r = d.create_receiver(6, addr, [1])
        pump([p, d], lambda: r.poll() == KVPoll.FAILED)
        assert r.error.code == ErrorCode.UNAUTHORIZED and "token" in r.error.message
        assert s.poll() == KVPoll.BOOTSTRAPPING  # nothing from the refused decode reached the room
    finally:
        p.close()
        d.close()


def test_cluster_token_accepted():
    p, d, addr = make_pair(cluster_token="secret")
    try:
        s = p.create_sender(6)
        r = d.create_receiver(6, addr, [1])
        pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
        s.send([2], is_last=True)
        pump([p, d], lambda: r.poll() == KVPoll.SUCCESS)
    finally:
        p.close()
        d.close()


def test_send_validation(pair):
    p, d, addr = pair
    s = p.create_sender(9)
    with pytest.raises(ValueError, match="before the decode"):
        s.send([1], is_last=True)
    r = d.create_receiver(9, addr, [1, 2])
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    with pytest.raises(ValueError, match="metadata only"):
        s.send([1], is_last=False, metadata={"x": 1})
    with pytest.raises(ValueError, match="out of range"):
        s.send([999], is_last=False)
    s.send([1, 2, 3], is_last=True)  # 3 pages into 2 reserved
    assert s.poll() == KVPoll.FAILED and "reserved 2" in s.error.message
    pump([p, d], lambda: r.poll() == KVPoll.FAILED)
    with pytest.raises(ValueError, match="dst_pages"):
        d.create_receiver(10, addr, [1, 1])
    with pytest.raises(ValueError, match="host:port"):
        d.create_receiver(11, "nohost", [1])


@pytest.mark.parametrize("decline_first", [False, True])
def test_declined_room_ends_on_the_prefill_without_data(pair, decline_first):
    """Conditional disaggregation: the decode prefills the room itself and says so; the prefill's
    sender reaches SUCCESS with `declined`, whether the notice came before or after create_sender."""
    p, d, addr = pair
    if decline_first:
        d.decline_room(11, addr)
        pump([p, d], lambda: p.stats().early_infos == 1)
    s = p.create_sender(11)
    if not decline_first:
        d.decline_room(11, addr)
    pump([p, d], lambda: s.poll() == KVPoll.SUCCESS)
    assert s.declined and s.pending() == 0
    with pytest.raises(ValueError):
        s.send([1], is_last=True, metadata={})
    s.release()
    assert p.active_rooms() == 0 and d.active_rooms() == 0


@pytest.mark.parametrize("early", [False, True])
def test_cached_prefix_skips_pages_or_is_refused(pair, early):
    """Decode-side reuse at the protocol level (page_size 4): a prefix that hashes as the prompt's
    makes the sender skip its pages (dst position 0 = prompt page 2); one that does not is refused
    with PREFIX_MISMATCH, the sender stays BOOTSTRAPPING, and a second TransferInfo for the whole
    prompt is accepted. Both with the TransferInfo arriving before and after create_sender."""
    p, d, addr = pair
    prompt = list(range(50, 61))  # 11 tokens: 3 pages
    other = [0] + prompt[1:]

    def open_room(room: int, cached: list[int], dst: list[int]):
        if early:
            r = d.create_receiver(room, addr, dst, cached)
            pump([p, d], lambda: p.stats().early_infos == 1)
            return p.create_sender(room, prompt), r
        s = p.create_sender(room, prompt)
        return s, d.create_receiver(room, addr, dst, cached)

    s, r = open_room(1, prompt[:8], [5])
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    assert s.reused_pages == 2 and s.num_dst_pages == 1
    s.send([9], is_last=True, metadata={"room": 1})
    pump([p, d], lambda: r.poll() == KVPoll.SUCCESS and s.poll() == KVPoll.SUCCESS)
    s.release()
    r.release()

    s, r = open_room(2, other[:8], [5])
    pump([p, d], lambda: r.poll() == KVPoll.FAILED)
    assert r.error is not None and r.error.code == ErrorCode.PREFIX_MISMATCH and "hash mismatch" in r.error.message
    assert s.poll() == KVPoll.BOOTSTRAPPING and p.stats().prefix_refusals == 1
    r.release()
    r = d.create_receiver(2, addr, [5, 6, 7])
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    assert s.reused_pages == 0 and s.num_dst_pages == 3
    s.send([1, 2, 3], is_last=True)
    pump([p, d], lambda: r.poll() == KVPoll.SUCCESS and s.poll() == KVPoll.SUCCESS)
    s.release()
    r.release()
    assert p.active_rooms() == 0 and d.active_rooms() == 0
