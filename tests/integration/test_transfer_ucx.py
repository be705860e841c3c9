"""Acceptance 1 and 2: two processes over real UCX (TCP), 100 rooms with random non-contiguous
page lists and random chunking; every destination page byte-identical to its source, all rooms
SUCCESS, sender and receiver state empty afterwards. Once over loopback, once between two network
namespaces joined by a veth pair (192.0.2.0/24, TEST-NET-1, only inside the namespaces)."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def selftest(*args: str, netns: str | None = None) -> subprocess.Popen:
    env = dict(os.environ, UCX_TLS="tcp", UCX_WARN_UNUSED_ENV_VARS="n", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "transfer.selftest", *args]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_event(proc: subprocess.Popen, event: str, timeout: float = 120.0) -> dict:
    """Next JSON line from proc's stdout with this event, before the deadline."""
    deadline = time.monotonic() + timeout
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = proc.stdout.readline()
            if not line:
                raise AssertionError(f"process exited ({proc.wait()}) before {event!r}: {proc.stderr.read()}")
            if line.startswith("{"):
                msg = json.loads(line)
                if msg.get("event") == event:
                    return msg
        raise AssertionError(f"no {event!r} event within {timeout}s")
    finally:
        sel.close()


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=30)
        p.stdout.close()
        p.stderr.close()


def assert_clean_success(done: dict, rooms: int) -> None:
    assert done["states"] == {"SUCCESS": rooms}, done
    assert done["active_rooms"] == 0
    stats = done["stats"]
    for key in (
        "senders",
        "receivers",
        "early_infos",
        "pending_sends",
        "pending_recvs",
        "staging_bytes",
        "draining",
        "backend_sinks",
    ):
        assert stats.get(key, 0) == 0, (key, stats)


def run_pair(prefill_host: str, decode_host: str, netns: tuple[str, str] | None = None) -> None:
    common = ["--rooms", "100", "--seed", "11"]
    p = selftest("--role", "prefill", "--host", prefill_host, *common, netns=netns and netns[0])
    d = None
    try:
        port = read_event(p, "ready")["bootstrap_port"]
        d = selftest(
            "--role",
            "decode",
            "--host",
            decode_host,
            "--bootstrap",
            f"{prefill_host}:{port}",
            *common,
            netns=netns and netns[1],
        )
        d_done = read_event(d, "done")
        p_done = read_event(p, "done")
        assert d_done["mismatched"] == []
        assert_clean_success(d_done, 100)
        assert_clean_success(p_done, 100)
    finally:
        stop(p, *([d] if d else []))


def test_loopback_100_rooms_byte_identical():
    run_pair("127.0.0.1", "127.0.0.1")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


@pytest.mark.netns
def test_network_namespaces_100_rooms_byte_identical():
    tag = str(os.getpid() % 100000)
    ns_a, ns_b, veth_a, veth_b = f"pdt-a-{tag}", f"pdt-b-{tag}", f"pdtva{tag}", f"pdtvb{tag}"
    try:
        sh("ip", "netns", "add", ns_a)
        sh("ip", "netns", "add", ns_b)
        sh("ip", "link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        sh("ip", "link", "set", veth_a, "netns", ns_a)
        sh("ip", "link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, "192.0.2.1/24"), (ns_b, veth_b, "192.0.2.2/24")):
            sh("ip", "-n", ns, "addr", "add", addr, "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        run_pair("192.0.2.1", "192.0.2.2", netns=(ns_a, ns_b))
    finally:
        for ns in (ns_a, ns_b):  # deleting a namespace removes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert ns_a not in listed and ns_b not in listed
