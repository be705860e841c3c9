"""Control-plane hygiene over real sockets: garbage sent to the bootstrap server and the control
endpoints is dropped and counted, no room changes state, and the rooms complete afterwards."""

from __future__ import annotations

import dataclasses
import random
import socket
import time
from collections.abc import Callable

import msgpack
import pytest
import torch
import zmq

from service.messages import StatsOut
from service.metrics import render_worker_stats
from service.stats import WorkerStats
from transfer import CompatInfo, KVPoll, TransferConfig, TransferManager
from transfer import messages as m

COMPAT = CompatInfo("m", "float32", 4, "page_major", 1, 1, 8)
TOKEN = "secret"


def pool() -> torch.Tensor:
    return torch.zeros(16, 1, 2, 4, 1, 8)  # [pages, layers, 2, page_size, kv_heads, head_dim]


def pump(mgrs: list[TransferManager], cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        for mgr in mgrs:
            mgr.progress()
        mgrs[0].idle_wait(0.002)


def wire(msg: object, **override: object) -> bytes:
    d = dataclasses.asdict(msg) | {"type": type(msg).__name__} | override  # type: ignore[call-overload]
    return msgpack.packb(d, use_bin_type=True)


def garbage(room: int) -> list[list[bytes]]:
    """Multipart messages a confused or hostile peer might send; each must be dropped."""
    rng = random.Random(17)
    info = m.TransferInfo(room, "evil", b"ucx", [1], 5, "hash", {}, token=TOKEN)
    good = m.encode(info)
    frames = [[rng.randbytes(n)] for n in (1, 7, 64, 512)]
    frames += [[good[:n]] for n in (1, len(good) // 2, len(good) - 1)]  # truncated msgpack
    frames += [[wire(info, version=m.VERSION + 1)], [wire(m.Abort(room, "x", 499, token=TOKEN), version=0)]]
    frames += [[wire(info, room=[room])], [wire(info, dst_pages="1")]]  # ill-typed fields
    frames += [[good, good]]  # two frames where one is expected
    return frames


def forged(room: int, token: str | None) -> list[bytes]:
    """Well-formed messages naming a live room, with a wrong or missing cluster token."""
    return [m.encode(x) for x in (
        m.Abort(room, "forged", 499, token=token), m.TransferStatus(room, int(KVPoll.SUCCESS), token=token),
        m.TransferInfo(room, "evil", b"ucx", [1], 5, COMPAT.digest(), COMPAT.to_dict(), token=token),
        m.ChunkManifest(room, [[0, [0]]], 1, True, {}, token=token))]


@pytest.fixture
def pair():
    p = TransferManager(TransferConfig(role="prefill", backend="fake", bootstrap_port=0, cluster_token=TOKEN),
                        pool(), COMPAT)
    d = TransferManager(TransferConfig(role="decode", backend="fake", cluster_token=TOKEN), pool(), COMPAT)
    yield p, d, f"127.0.0.1:{p.bootstrap_port}"
    p.close()
    d.close()


def test_prefill_sockets_drop_and_count_garbage(pair):
    p, d, addr = pair
    live_s, idle_s = p.create_sender(5), p.create_sender(6)
    live_r = d.create_receiver(5, addr, [1, 2])
    pump([p, d], lambda: live_s.poll() == live_r.poll() == KVPoll.WAITING_FOR_INPUT)
    zctx = zmq.Context()
    try:
        sent = 0
        socks = []  # kept open until counted: a collected socket with LINGER 0 drops what it had queued
        for endpoint in (f"tcp://{addr}", p._side.control.endpoint):
            sock = zctx.socket(zmq.DEALER)
            socks.append(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            for frames in garbage(6):
                sock.send_multipart(frames)
                sent += 1
            for frame in [*forged(5, "wrong"), *forged(6, None)]:
                sock.send(frame)
                sent += 1
        dropped = lambda: sum(p.stats().control_dropped.values())  # noqa: E731
        pump([p, d], lambda: dropped() >= sent)
        counts = p.stats().control_dropped
        assert dropped() == sent, counts
        assert counts["undecodable"] == 2 * 9 and counts["version"] == 2 * 2 and counts["frames"] == 2
        assert counts["unauthorized"] >= 8
        for port in (p.bootstrap_port, int(p._side.control.endpoint.rsplit(":", 1)[1])):
            raw = socket.create_connection(("127.0.0.1", port))  # raw TCP: libzmq may read it as ZMTP 1.0
            raw.sendall(random.Random(port).randbytes(4096))
            raw.close()
        pump([p, d], lambda: sum(p.stats().control_dropped.values()) > sent, timeout=2.0)
        assert live_s.poll() == KVPoll.WAITING_FOR_INPUT and idle_s.poll() == KVPoll.BOOTSTRAPPING
        assert live_r.poll() == KVPoll.WAITING_FOR_INPUT and p.stats().early_infos == 0
        # the worker keeps serving: both rooms complete with the real decode
        idle_r = d.create_receiver(6, addr, [3])
        pump([p, d], lambda: idle_s.poll() == KVPoll.WAITING_FOR_INPUT)
        live_s.send([4, 5], is_last=True, metadata={"room": 5})
        idle_s.send([6], is_last=True, metadata={"room": 6})
        pump([p, d], lambda: all(x.poll() == KVPoll.SUCCESS for x in (live_s, live_r, idle_s, idle_r)))
    finally:
        zctx.destroy(linger=0)


def test_decode_sockets_drop_and_count_garbage(pair):
    p, d, addr = pair
    zctx = zmq.Context()
    fake = zctx.socket(zmq.ROUTER)  # a "prefill" that answers the bootstrap query with garbage
    fake.setsockopt(zmq.LINGER, 0)
    try:
        port = fake.bind_to_random_port("tcp://127.0.0.1")
        r = d.create_receiver(9, f"127.0.0.1:{port}", [1])
        ident = None
        deadline = time.monotonic() + 5
        while ident is None:
            assert time.monotonic() < deadline
            d.progress()
            if fake.poll(10):
                ident = fake.recv_multipart()[0]
        n = 0
        for frames in garbage(9):
            fake.send_multipart([ident, *frames])
            n += 1
        for frame in forged(9, "wrong"):
            fake.send_multipart([ident, frame])
            n += 1
        fake.send_multipart([ident, m.encode(m.TransferInfo(9, "e", b"u", [1], 5, "h", {}, token=TOKEN))])
        n += 1  # authorized, but not a message a bootstrap server sends
        pump([d], lambda: sum(d.stats().control_dropped.values()) >= n)
        counts = d.stats().control_dropped
        assert sum(counts.values()) == n and counts["unexpected"] == 1, counts
        assert r.poll() == KVPoll.BOOTSTRAPPING
        # the same decode still serves a room from a real prefill
        s = p.create_sender(10)
        r2 = d.create_receiver(10, addr, [2])
        pump([p, d], lambda: s.poll() == KVPoll.WAITING_FOR_INPUT)
        s.send([3], is_last=True)
        pump([p, d], lambda: r2.poll() == KVPoll.SUCCESS)
        r.release()
    finally:
        zctx.destroy(linger=0)


def test_dropped_counts_reach_metrics(pair):
    p, _, _ = pair
    p._side.dropped.add("undecodable", "test")
    lines = render_worker_stats(StatsOut(token=1, info={}, stats=WorkerStats(link=p.stats())))
    assert 'pdserve_worker_transfer_control_dropped_total{name="undecodable"} 1.0' in lines
