"""A prefill restarted at the same bootstrap address (a killed worker started again, as Kubernetes
or `pdserve up` does) serves the next room of a decode that knew the old process at once: the decode
asks the bootstrap server again before using a control connection that has been silent and idle for
a heartbeat interval, and reconnects when a new process answers. Found by the split-node chaos suite
(loadtest/chaosnet.py, kill-prefill): the first room to the restarted prefill went to the dead
process's control endpoint and failed only after 3 missed heartbeats (15 s by default)."""

from __future__ import annotations

import time

from tests.unit.test_transfer_fake import COMPAT, make_pair, pool, pump
from transfer import KVPoll, TransferConfig, TransferManager


def _one_room(p: TransferManager, d: TransferManager, addr: str, room: int) -> None:
    s = p.create_sender(room)
    r = d.create_receiver(room, addr, [1])
    pump([p, d], lambda: r.poll() in (KVPoll.WAITING_FOR_INPUT, KVPoll.FAILED))
    assert r.poll() == KVPoll.WAITING_FOR_INPUT, r.error
    pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
    s.send([2], is_last=True)
    pump([p, d], lambda: s.poll() == KVPoll.SUCCESS and r.poll() == KVPoll.SUCCESS)
    s.release()
    r.release()


def _idle(d: TransferManager, seconds: float) -> None:
    t0 = time.monotonic()
    pump([d], lambda: time.monotonic() - t0 > seconds)  # the decode keeps running, the peer is idle


def test_restarted_prefill_at_same_address_serves_next_room():
    p, d, addr = make_pair(heartbeat_interval_s=0.2)
    port = p.bootstrap_port
    p2 = None
    try:
        _one_room(p, d, addr, 1)
        p.close()  # killed; started again on the same bootstrap port, a new control endpoint
        p2 = TransferManager(TransferConfig(role="prefill", backend="fake", bootstrap_port=port,
                                            heartbeat_interval_s=0.2), pool(), COMPAT)
        _idle(d, 0.3)
        t0 = time.monotonic()
        _one_room(p2, d, addr, 2)  # before the fix: FAILED after 3 missed heartbeats (0.6 s)
        assert time.monotonic() - t0 < 0.6
        assert d.stats().peers == 1
    finally:
        for m in (p, p2, d):
            if m is not None:
                m.close()


def test_idle_peer_that_did_not_restart_keeps_its_connection():
    p, d, addr = make_pair(heartbeat_interval_s=0.2)
    try:
        _one_room(p, d, addr, 3)
        ctrl = d._side.peers[addr].ctrl
        _idle(d, 0.3)
        _one_room(p, d, addr, 4)  # asked again, the same process answered: same connection
        assert d._side.peers[addr].ctrl is ctrl
    finally:
        p.close()
        d.close()
