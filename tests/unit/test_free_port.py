"""common.procs.free_port: ports outside the kernel's ephemeral range, never the same twice in a process."""

from __future__ import annotations

import socket

import pytest

from common import procs


def test_ports_are_outside_the_ephemeral_range_distinct_and_free() -> None:
    lo, hi = (int(x) for x in procs.EPHEMERAL.read_text().split()) if procs.EPHEMERAL.exists() else (32768, 60999)
    ports = [procs.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if procs._outside_ephemeral():
        assert not any(lo <= p <= hi for p in ports), "a port the kernel could hand to an outgoing connection"
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free: nothing took it


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        taken = busy.getsockname()[1]
        busy.listen()
        monkeypatch.setattr(procs, "_outside_ephemeral", lambda: range(taken, taken + 1))
        monkeypatch.setattr(procs, "_handed", set())
        port = procs.free_port()  # the one candidate is in use: the OS picks
        assert port != taken
