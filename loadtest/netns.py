"""Network namespaces for split-node load tests: one namespace per node, joined by veth links.

Topology (nothing is added to the root namespace):

    {prefix}-sw   a switch namespace holding bridge br0
    {prefix}-X    one namespace per node X; veth pair eth0 (in X) <-> vX (in sw, a br0 port)
                  eth0 gets 192.0.2.N/24 (TEST-NET-1), loopback up

Optional shaping on each node's eth0 egress: `tc netem delay D rate R`; kernels without sch_netem
fall back to tbf for the rate (delay then raises ValueError: it cannot be honoured).

`Netns.create()` deletes stale namespaces with the same prefix first; `teardown()` kills every
process started through `spawn` (process groups) and deletes the namespaces. Use it as a context
manager; SIGINT/SIGTERM raise KeyboardInterrupt/SystemExit inside it so teardown still runs.

`entered(ns)` moves the calling thread into a namespace for a `with` block (setns(2); the thread's
sockets opened inside live there), so a harness can talk to the nodes with ordinary clients.
`set_link(node, up)` takes a node's eth0 down or up (`ip link set eth0 down|up` inside its namespace).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

SUBNET = "192.0.2"  # TEST-NET-1: documentation range, never routed
CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class Shaping:
    delay_ms: float = 0.0
    rate: str = ""  # tc rate, e.g. "1gbit"; "" = unlimited

    @property
    def active(self) -> bool:
        return self.delay_ms > 0 or bool(self.rate)


@dataclass(frozen=True)
class NetnsConfig:
    prefix: str = "pdl"
    nodes: tuple[str, ...] = ("rtr", "pre", "dec")
    shaping: Shaping = field(default_factory=Shaping)

    def __post_init__(self) -> None:
        if not self.prefix.isalnum() or len(self.prefix) > 8:
            raise ValueError("netns prefix must be alphanumeric, at most 8 characters")
        if not self.nodes or len(set(self.nodes)) != len(self.nodes) or len(self.nodes) > 50:
            raise ValueError("netns nodes must be 1..50 distinct names")
        if any(not n.isalnum() or len(n) > 8 for n in self.nodes):
            raise ValueError("netns node names must be alphanumeric, at most 8 characters")

    def ns(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def ip(self, node: str) -> str:
        return f"{SUBNET}.{self.nodes.index(node) + 1}"


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}): {res.stderr.strip()}")
    return res


def list_netns() -> list[str]:
    out = sh("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


class Netns:
    def __init__(self, cfg: NetnsConfig) -> None:
        self.cfg = cfg
        self.procs: list[subprocess.Popen] = []
        self.created: list[str] = []

    def __enter__(self) -> Netns:
        self._old = {s: signal.getsignal(s) for s in (signal.SIGTERM,)}
        signal.signal(signal.SIGTERM, _raise_exit)
        try:
            self.create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.teardown()
        finally:
            for s, h in self._old.items():
                signal.signal(s, h)

    def delete_stale(self) -> list[str]:
        stale = [n for n in list_netns() if n.startswith(self.cfg.prefix + "-")]
        for n in stale:
            log.warning("deleting stale namespace %s", n)
            _kill_ns_pids(n)
            sh("ip", "netns", "del", n, check=False)
        return stale

    def create(self) -> None:
        c = self.cfg
        self.delete_stale()
        for ns in [c.switch] + [c.ns(n) for n in c.nodes]:
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sw = c.switch
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        for node in c.nodes:
            ns, port = c.ns(node), f"v{node}"
            sh("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            sh("ip", "-n", sw, "link", "set", port, "master", "br0")
            sh("ip", "-n", sw, "link", "set", port, "up")
            sh("ip", "-n", ns, "addr", "add", f"{c.ip(node)}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            if c.shaping.active:
                self._shape(ns)

    def _shape(self, ns: str) -> None:
        s = self.cfg.shaping
        netem = ["tc", "qdisc", "add", "dev", "eth0", "root", "netem"]
        if s.delay_ms > 0:
            netem += ["delay", f"{s.delay_ms}ms"]
        if s.rate:
            netem += ["rate", s.rate]
        res = subprocess.run(["ip", "netns", "exec", ns, *netem], capture_output=True, text=True)
        if res.returncode == 0:
            return
        if s.delay_ms > 0 or "unknown" not in res.stderr.lower():
            raise ValueError(f"tc netem failed in {ns} (kernel without sch_netem?): {res.stderr.strip()}")
        log.warning("no sch_netem in this kernel: shaping %s with tbf rate %s", ns, s.rate)
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf",
           "rate", s.rate, "burst", "256kb", "latency", "50ms")

    def spawn(self, node: str, argv: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
        """Start argv inside node's namespace, in its own process group, output to log_path."""
        logf = open(log_path, "ab")  # noqa: SIM115 (closed with the process in teardown)
        full_env = os.environ | (env or {})
        p = subprocess.Popen(["ip", "netns", "exec", self.cfg.ns(node), *argv], stdout=logf,
                             stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        p._pdl_log = logf  # type: ignore[attr-defined]
        self.procs.append(p)
        return p

    def set_link(self, node: str, up: bool) -> None:
        """Take node's eth0 (its only link to the other nodes) up or down."""
        sh("ip", "-n", self.cfg.ns(node), "link", "set", "eth0", "up" if up else "down")

    def run(self, node: str, argv: list[str], timeout: float, env: dict | None = None
            ) -> subprocess.CompletedProcess:
        """Run argv to completion inside node's namespace (output captured)."""
        return subprocess.run(["ip", "netns", "exec", self.cfg.ns(node), *argv], capture_output=True,
                              text=True, timeout=timeout, env=os.environ | (env or {}))

    def teardown(self) -> None:
        for p in self.procs:
            _stop_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _stop_group(p, signal.SIGKILL)
                p.wait(timeout=5)
            p._pdl_log.close()  # type: ignore[attr-defined]
        self.procs.clear()
        for ns in reversed(self.created):
            _kill_ns_pids(ns)
            sh("ip", "netns", "del", ns, check=False)
        self.created.clear()


@contextmanager
def entered(ns: str) -> Iterator[None]:
    """Run the calling thread inside network namespace `ns` (by name) for the block, then move it back.
    Only this thread moves; threads it starts meanwhile stay in `ns`."""
    libc = ctypes.CDLL(None, use_errno=True)

    def setns(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            if libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns({path}): {os.strerror(err)}")
        finally:
            os.close(fd)

    home = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    try:
        setns(f"/run/netns/{ns}")
        try:
            yield
        finally:
            if libc.setns(home, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to the original namespace failed")
    finally:
        os.close(home)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _stop_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass


def _kill_ns_pids(ns: str) -> None:
    """SIGKILL whatever still runs inside a namespace we created (e.g. a stray grandchild)."""
    res = sh("ip", "netns", "pids", ns, check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
