"""Local child processes and free ports: the one launcher of `pdserve up`, the load-test
experiments, the benchmarks and the test harnesses.

    port = free_port()
    c = Child("decode-0", [sys.executable, "-m", "pdserve", "decode", "--port", str(port)], log_dir / "d.log",
              url=f"http://127.0.0.1:{port}")
    wait_until(c.healthy, 300, "decode healthy")
    stop_all([c], grace=10)

Each child runs in its own session (process group) with its output in a log file. Stopping sends
SIGTERM to the child (a service drains, then stops its own worker), and SIGKILL to the whole group
of whatever is still running after the grace period.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import httpx

T = TypeVar("T")


EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
_handed: set[int] = set()  # ports this process's free_port gave out


def _outside_ephemeral() -> range:
    """Ports the kernel never hands out by itself (below, else above, its ephemeral range), at least 4096 of
    them; an empty range where there are not that many."""
    try:
        lo, hi = (int(x) for x in EPHEMERAL.read_text().split())
    except (OSError, ValueError):
        lo, hi = 32768, 60999  # Linux's default
    if lo - 10000 >= 4096:
        return range(10000, lo)
    if 65535 - hi >= 4096:
        return range(hi + 1, 65536)
    return range(0)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now, never the same one twice in this process. Drawn outside the
    kernel's ephemeral range: a port the OS picked (bind to port 0) is in that range, and until its user binds
    it any outgoing connection or port-0 bind on the machine may take it as its own (seen: a service failing
    to start with "address already in use" while other services connected around it)."""
    span = _outside_ephemeral()
    rng = random.SystemRandom()
    for _ in range(256 if span else 0):
        port = rng.choice(span)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue  # in use (or in TIME_WAIT): another
        _handed.add(port)
        return port
    with socket.socket() as s:  # no room outside the ephemeral range: let the OS pick
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed.add(port)
    return port


def wait_until(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `cond` until it returns something truthy (returned); TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str, headers: Mapping[str, str] | None = None, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(url, headers=dict(headers or {}), timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


class Child:
    """One child process in its own session, stdout and stderr in `log_path`."""

    def __init__(self, name: str, argv: list[str], log_path: str | Path, url: str = "",
                 env: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> None:
        self.name, self.argv, self.url, self.log_path = name, argv, url, Path(log_path)
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          cwd=cwd, env={**os.environ, **(env or {})}, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError as e:
            return f"(no log: {e})"

    def healthy(self, headers: Mapping[str, str] | None = None, path: str = "/health") -> bool:
        """GET url+path answers 200; RuntimeError with the log tail once the child has exited."""
        if not self.alive():
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
        return http_ok(self.url + path, headers)

    def signal(self, sig: int, group: bool = False) -> None:
        if not self.alive():
            return
        try:
            if group:
                os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the child's whole process group and reap it."""
        self.signal(signal.SIGKILL, group=True)
        self.popen.wait(10)

    def stop(self, grace: float = 10.0) -> int | None:
        stop_all([self], grace)
        return self.popen.returncode


def stop_all(children: list[Child], grace: float, on_kill: Callable[[Child], Any] | None = None) -> None:
    """SIGTERM every child still running (in list order), SIGKILL the groups left after `grace` s."""
    for c in children:
        c.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if on_kill is not None:
                on_kill(c)
            c.kill()
