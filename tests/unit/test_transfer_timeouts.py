"""Timeouts of the transfer state machine (fake backend, real zmq): each ends in FAILED with a
message and frees the room's state. Small timeouts, polled with a deadline."""

from __future__ import annotations

import time

from tests.unit.test_transfer_fake import COMPAT, make_pair, pool, pump
from transfer import ErrorCode, KVPoll, TransferConfig, TransferManager


def test_bootstrap_timeout_when_decode_never_arrives():
    p, d, _ = make_pair(bootstrap_timeout_s=0.3)
    try:
        s = p.create_sender(1)
        t0 = time.monotonic()
        pump([p], lambda: s.poll() == KVPoll.FAILED)
        assert time.monotonic() - t0 >= 0.3
        assert s.error.code == ErrorCode.TIMEOUT and "no TransferInfo" in s.error.message
        assert s.error.peer_fault  # the decode never came: the router blames the decode
        s.release()
        assert p.active_rooms() == 0
    finally:
        p.close()
        d.close()


def test_waiting_timeout_when_kv_never_arrives():
    p, d, addr = make_pair(d_waiting_timeout_s=0.4)
    try:
        s = p.create_sender(2)
        r = d.create_receiver(2, addr, [1, 2])
        pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
        s.send([3], is_last=False)  # half the KV, then nothing
        pump([p, d], lambda: r.poll() == KVPoll.FAILED and s.poll() == KVPoll.FAILED)
        assert r.error.code == ErrorCode.TIMEOUT and "not complete within" in r.error.message
        assert r.error.peer_fault
        assert "not complete within" in s.error.message  # the abort carried the reason
        assert d.stats().pending_recvs == 0 and p.stats().pending_sends == 0
    finally:
        p.close()
        d.close()


def test_early_transfer_info_expires():
    p, d, addr = make_pair(bootstrap_timeout_s=0.3)
    try:
        r = d.create_receiver(3, addr, [1])
        pump([p, d], lambda: r.poll() == KVPoll.FAILED)
        assert r.error.code == ErrorCode.TIMEOUT and "no prefill request" in r.error.message
        assert p.stats().early_infos == 0
    finally:
        p.close()
        d.close()


def test_prefill_silent_fails_receiver_after_missed_heartbeats():
    p, d, addr = make_pair(heartbeat_interval_s=0.1)
    try:
        t0 = time.monotonic()  # the last heartbeat reply the decode gets arrives after this, so no failure
        s = p.create_sender(4)  # may be declared before t0 + 3 intervals (a busy box can pump the first
        r = d.create_receiver(4, addr, [1])  # phase slowly: counting from its end would be a timing bet)
        pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
        pump([d], lambda: r.poll() == KVPoll.FAILED)  # the prefill stops progressing
        assert time.monotonic() - t0 >= 0.3
        assert r.error.code == ErrorCode.PEER_LOST and "heartbeats" in r.error.message
        assert r.error.peer_fault  # a silent prefill is the prefill's fault, not the reporting decode's
        assert d.stats().peers == 0
    finally:
        p.close()
        d.close()


def test_decode_gone_fails_sender_after_missed_heartbeats():
    p, d, addr = make_pair(heartbeat_interval_s=0.1)
    try:
        s = p.create_sender(5)
        r = d.create_receiver(5, addr, [1])
        pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT and r.poll() == KVPoll.WAITING_FOR_INPUT)
        d.close()
        pump([p], lambda: s.poll() == KVPoll.FAILED)
        assert s.error.code == ErrorCode.PEER_LOST and "decode" in s.error.message
        assert s.error.peer_fault
    finally:
        p.close()


def test_unreachable_bootstrap_server_fails_receiver():
    d = TransferManager(TransferConfig(role="decode", backend="fake", heartbeat_interval_s=0.1), pool(),
                        COMPAT)
    p, _, addr = make_pair()
    p.close()  # nothing listens on addr any more
    try:
        r = d.create_receiver(6, addr, [1])
        pump([d], lambda: r.poll() == KVPoll.FAILED)
        assert r.error.code == ErrorCode.PEER_LOST and addr in r.error.message
        r.release()
        assert d.active_rooms() == 0
    finally:
        d.close()
        _.close()
