"""Acceptance 3: faults between two (or three) processes over real UCX (TCP, loopback).

- prefill killed mid-transfer -> the decode's open rooms FAILED within 3 heartbeats, buffers free;
- decode killed mid-transfer -> the prefill's open rooms FAILED;
- compatibility-hash mismatch -> both sides FAILED at the handshake, the message names the field;
- a second decode claims a room -> it gets DUPLICATE_ROOM, the first keeps the room (in-process).
"""

from __future__ import annotations

import signal
import time

import pytest
import torch

from tests.integration.test_transfer_ucx import read_event, selftest, stop
from tests.unit.test_transfer_fake import COMPAT, pump
from transfer import ErrorCode, KVPoll, TransferConfig, TransferManager

pytestmark = pytest.mark.slow
HB = 0.2  # heartbeat interval: a peer is lost after 3 * HB


def assert_freed(done: dict) -> None:
    assert done["active_rooms"] == 0
    for key in ("pending_sends", "pending_recvs", "staging_bytes", "early_infos"):
        assert done["stats"].get(key, 0) == 0, (key, done["stats"])


def start_pair(p_args: list[str], d_args: list[str], rooms: int = 40, hb: float = HB):
    common = ["--rooms", str(rooms), "--seed", "5", "--heartbeat", str(hb)]
    p = selftest("--role", "prefill", *common, *p_args)
    port = read_event(p, "ready")["bootstrap_port"]
    d = selftest("--role", "decode", "--bootstrap", f"127.0.0.1:{port}", *common, *d_args)
    return p, d, port


def test_prefill_killed_fails_receivers_within_timeout():
    p, d, _ = start_pair(["--stall-after", "30"], [])
    try:
        read_event(p, "stalled")
        p.send_signal(signal.SIGKILL)
        t_kill = time.monotonic()
        done = read_event(d, "done")
        elapsed = time.monotonic() - t_kill
        assert elapsed < 3 * HB + 5.0, elapsed  # 3 missed heartbeats + process slack
        assert done["states"].get("FAILED", 0) > 0, done
        assert all(e["code"] == 503 and "heartbeats" in e["message"] for e in done["errors"]), done
        assert done["mismatched"] == []  # rooms that completed before the kill are intact
        assert_freed(done)
    finally:
        stop(p, d)


def test_decode_killed_fails_senders():
    # sends spread over ~5 s, so the decode dies with rooms still open whatever the machine's load
    p, d, _ = start_pair(["--send-interval", "0.05"], ["--stall-after", "5"])
    try:
        read_event(d, "stalled")
        d.send_signal(signal.SIGKILL)
        done = read_event(p, "done", timeout=60)
        assert done["states"].get("FAILED", 0) > 0, done
        # rooms with sends in flight see the UCX connection reset (500), the rest miss heartbeats (503)
        assert all((e["code"] == 503 and "decode" in e["message"]) or
                   (e["code"] == 500 and "UCX" in e["message"]) for e in done["errors"]), done
        assert_freed(done)
    finally:
        stop(p, d)


def test_hash_mismatch_fails_both_sides_naming_field():
    p, d, _ = start_pair([], ["--model", "other-model"], rooms=5)
    try:
        d_done, p_done = read_event(d, "done"), read_event(p, "done")
        for done in (d_done, p_done):
            assert done["states"] == {"FAILED": 5}, done
            assert all(e["code"] == 412 and "'model'" in e["message"] for e in done["errors"]), done
            assert_freed(done)
    finally:
        stop(p, d)


def test_duplicate_room_from_second_decode_over_ucx():
    """In one process (three UCX workers) so the order of the two claims is deterministic."""
    src = torch.randn(16, 2, 2, 4, 1, 8)  # [pages, layers, 2, page_size, kv_heads, head_dim]
    dst1, dst2 = torch.zeros_like(src), torch.zeros_like(src)
    p = TransferManager(TransferConfig(role="prefill", bootstrap_port=0), src, COMPAT)
    d1 = TransferManager(TransferConfig(role="decode"), dst1, COMPAT)
    d2 = TransferManager(TransferConfig(role="decode"), dst2, COMPAT)
    addr = f"127.0.0.1:{p.bootstrap_port}"
    try:
        s = p.create_sender(77)
        r1 = d1.create_receiver(77, addr, [2, 3, 9])
        pump([p, d1, d2], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
        r2 = d2.create_receiver(77, addr, [4, 5, 6])
        pump([p, d1, d2], lambda: r2.poll() == KVPoll.FAILED)
        assert r2.error.code == ErrorCode.DUPLICATE_ROOM and "room 77" in r2.error.message
        s.send([1, 2], is_last=False)
        s.send([7], is_last=True, metadata={"room": 77})
        pump([p, d1, d2], lambda: s.poll() == KVPoll.SUCCESS and r1.poll() == KVPoll.SUCCESS)
        assert torch.equal(dst1[[2, 3, 9]], src[[1, 2, 7]]) and (dst2 == 0).all()
        for room in (s, r1, r2):
            room.release()
        assert p.active_rooms() == d1.active_rooms() == d2.active_rooms() == 0
    finally:
        for m in (p, d1, d2):
            m.close()
