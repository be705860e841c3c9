"""Rooms held in a decode's queue (issue 53): real zmq, the fake data backend. A decode that holds a
room (TransferManager.hold_room) lists it in its heartbeats, and the prefill keeps that room waiting
past its bootstrap timeout, counted from the decode's last word; a room ended on either side while
held is ended on the other. Small timeouts, every wait a condition polled with a deadline."""

from __future__ import annotations

import time

from tests.unit.test_transfer_fake import make_pair, pump
from transfer import ErrorCode, KVPoll

TIMEOUT_S = 0.3  # the prefill's bootstrap timeout; the decode, given the same, speaks every 0.1 s (not 5)


def _outlives(mgrs: list, seconds: float) -> None:
    """Pump the managers until `seconds` have passed (the room must survive that long)."""
    t0 = time.monotonic()
    pump(mgrs, lambda: time.monotonic() - t0 > seconds)


def test_a_held_room_outlives_the_bootstrap_timeout_then_transfers():
    p, d, addr = make_pair(bootstrap_timeout_s=TIMEOUT_S)
    try:
        s = p.create_sender(1)
        d.progress()  # a heartbeat tick with nothing held: the next regular one is 5 s away
        d.hold_room(1, addr)
        pump([p, d], lambda: p.stats().kept_queued == 1)  # counted once it outlived the timeout
        _outlives([p, d], 3 * TIMEOUT_S)
        assert s.poll() == KVPoll.BOOTSTRAPPING and s.queued_at > 0 and p.stats().kept_queued == 1
        r = d.create_receiver(1, addr, [3, 4])  # admitted: the receiver takes the hold over
        pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
        s.send([1, 2], is_last=True, metadata={"first_token": 5})
        pump([p, d], lambda: s.poll() == KVPoll.SUCCESS and r.poll() == KVPoll.SUCCESS)
        s.release()
        r.release()
        assert p.active_rooms() == 0 and d.active_rooms() == 0
    finally:
        p.close()
        d.close()


def test_a_room_times_out_once_its_decode_stops_saying_it_is_queued():
    p, d, addr = make_pair(bootstrap_timeout_s=TIMEOUT_S)
    try:
        s = p.create_sender(2)
        d.hold_room(2, addr)
        pump([p, d], lambda: s.queued_at > 0)
        d.close()  # the decode dies: no more words
        t0 = time.monotonic()
        pump([p], lambda: s.poll() == KVPoll.FAILED)
        assert time.monotonic() - t0 <= 2 * TIMEOUT_S + 0.2  # from its last word, not from now
        assert s.error.code == ErrorCode.TIMEOUT and "last said it was queued" in s.error.message
        assert s.error.peer_fault
    finally:
        p.close()


def test_a_room_the_decode_ends_in_its_queue_ends_on_the_prefill():
    p, d, addr = make_pair(bootstrap_timeout_s=5.0, heartbeat_interval_s=0.1)
    try:
        s = p.create_sender(3)
        d.hold_room(3, addr)
        pump([p, d], lambda: s.queued_at > 0)
        d.end_room(3, addr, "waited 1 s for decode KV memory (--queue-timeout)", 503)
        pump([p, d], lambda: s.poll() == KVPoll.FAILED)
        assert s.error.code == 503 and "--queue-timeout" in s.error.message and s.error.peer_fault
        s.release()
        assert p.active_rooms() == 0 and p.stats().senders == 0
        assert d.ended_rooms() == {}  # the decode ended it itself
    finally:
        p.close()
        d.close()


def test_a_room_refused_before_the_prefill_opened_it_fails_when_it_opens():
    p, d, addr = make_pair(bootstrap_timeout_s=5.0, heartbeat_interval_s=0.1)
    try:
        d.end_room(4, addr, "decode queue full: 1 requests wait for KV memory (--max-queued-requests)", 503)
        pump([p, d], lambda: p.stats().peers == 1)  # the Abort arrived (the peer spoke)
        s = p.create_sender(4)
        assert s.poll() == KVPoll.FAILED and s.error.code == 503 and "queue full" in s.error.message
        assert s.error.peer_fault
    finally:
        p.close()
        d.close()


def test_a_held_room_the_prefill_ends_is_reported_to_the_decode():
    p, d, addr = make_pair(bootstrap_timeout_s=5.0, heartbeat_interval_s=0.1)
    try:
        s = p.create_sender(5)
        d.hold_room(5, addr)
        pump([p, d], lambda: s.queued_at > 0)
        s.abort("prefill worker shutting down")
        ended: dict = {}
        pump([p, d], lambda: bool(ended.update(d.ended_rooms()) or ended))
        assert list(ended) == [5] and "shutting down" in ended[5].message and ended[5].peer_fault
        d.end_room(5, addr, "aborted", 499)  # the decode ends its request: no Abort echoes back
        assert d.ended_rooms() == {}
    finally:
        p.close()
        d.close()
