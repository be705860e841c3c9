"""The split-node harness's namespaces: veth/bridge wiring, shaping, bench across namespaces, teardown
(normal, stale leftovers, SIGINT). Needs root (CI runs as root); uses only namespaces it creates."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from loadtest.netns import Netns, NetnsConfig, Shaping, entered, list_netns

REPO = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(REPO)}

pytestmark = [pytest.mark.slow, pytest.mark.netns]


def ours(prefix: str) -> list[str]:
    return [n for n in list_netns() if n.startswith(prefix + "-")]


def test_bench_across_namespaces_then_teardown(tmp_path):
    subprocess.run(["ip", "netns", "add", "pdlt-stale"], check=True)  # a leftover from a killed run
    cfg = NetnsConfig(prefix="pdlt", nodes=("cli", "srv"), shaping=Shaping(rate="200mbit"))
    with Netns(cfg) as net:
        assert sorted(ours("pdlt")) == ["pdlt-cli", "pdlt-srv", "pdlt-sw"]  # stale one deleted
        qdisc = net.run("srv", ["tc", "qdisc", "show", "dev", "eth0"], timeout=10).stdout
        assert "200Mbit" in qdisc
        srv = net.spawn("srv", [sys.executable, "-m", "loadtest.standin", "--host", cfg.ip("srv"),
                                "--port", "8123", "--itl", "0.002"], tmp_path / "srv.log", ENV)
        url = f"http://{cfg.ip('srv')}:8123"
        probe = net.run("cli", [sys.executable, "-m", "loadtest.probe", url + "/health", "--wait", "30"],
                        timeout=60, env=ENV)
        assert json.loads(probe.stdout)[0]["status"] == 200, probe.stderr
        with pytest.raises(httpx.HTTPError):  # the root namespace has no route to the test net
            httpx.get(url + "/health", timeout=1)
        out = tmp_path / "bench"
        res = net.run("cli", [sys.executable, "-m", "loadtest.cli", "--url", url, "--num-requests", "8",
                              "--request-rate", "50", "--input-len", "32", "--output-len", "6",
                              "--out", str(out), "--no-progress"], timeout=120, env=ENV)
        assert res.returncode == 0, res.stdout + res.stderr
        s = json.loads((out / "bench.json").read_text())["summary"]
        assert (s["completed"], s["failed"], s["output_tokens"]) == (8, 0, 48)
        assert srv.poll() is None
    assert srv.poll() is not None  # killed in teardown
    assert ours("pdlt") == []


def test_sigint_tears_down(tmp_path):
    script = textwrap.dedent("""
        import signal, sys, time
        from pathlib import Path
        from loadtest.netns import Netns, NetnsConfig
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
        with Netns(NetnsConfig(prefix="pdlu", nodes=("x",))) as net:
            p = net.spawn("x", ["sleep", "300"], Path(sys.argv[1]))
            print(p.pid, flush=True)
            time.sleep(300)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "x.log")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env=os.environ | ENV)
    pid = int(proc.stdout.readline())
    assert sorted(ours("pdlu")) == ["pdlu-sw", "pdlu-x"]
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) != 0
    assert ours("pdlu") == []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
        time.sleep(0.05)  # poll: the ip-netns-exec wrapper is reaped, its child follows
    assert not Path(f"/proc/{pid}").exists()


def test_config_validation():
    with pytest.raises(ValueError, match="prefix"):
        NetnsConfig(prefix="bad-prefix")
    with pytest.raises(ValueError, match="distinct"):
        NetnsConfig(nodes=("a", "a"))


def test_entered_namespace_and_link_down_up(tmp_path):
    """`entered` moves this thread into a node's namespace and back; `set_link` cuts the node off."""
    cfg = NetnsConfig(prefix="pdle", nodes=("a", "b"))
    with Netns(cfg) as net:
        srv = net.spawn("b", [sys.executable, "-m", "loadtest.standin", "--host", cfg.ip("b"), "--port", "8124"],
                        tmp_path / "b.log", ENV)
        url = f"http://{cfg.ip('b')}:8124/health"
        with entered(cfg.ns("a")):
            assert "eth0" in [name for _, name in socket.if_nameindex()]
            deadline = time.monotonic() + 30
            while True:  # the stand-in starts
                try:
                    assert httpx.get(url, timeout=1).status_code == 200
                    break
                except httpx.HTTPError:
                    assert time.monotonic() < deadline and srv.poll() is None
            net.set_link("b", False)
            with pytest.raises(httpx.HTTPError):
                httpx.get(url, timeout=1)
            net.set_link("b", True)
            assert httpx.get(url, timeout=5).status_code == 200
        with pytest.raises(httpx.HTTPError):  # back in the root namespace: no route to the test net
            httpx.get(url, timeout=1)
    assert ours("pdle") == []
