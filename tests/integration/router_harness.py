"""Process helpers for router tests: free ports, stub workers and routers as real subprocesses,
polling with deadlines (never fixed sleeps)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(__file__).with_name("stub_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def http_ok(url: str, headers: dict | None = None) -> bool:
    try:
        return httpx.get(url, timeout=1.0, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False


class Proc:
    """A child process with its output in a temp file."""

    def __init__(self, name: str, args: list[str], url: str, headers: dict | None = None) -> None:
        self.name, self.args, self.url, self.headers = name, args, url, headers or {}
        self.log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.popen = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)

    def tail(self, n: int = 30) -> str:
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])

    def wait_healthy(self, timeout: float = 30.0, path: str = "/health") -> None:
        def ok() -> bool:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            return http_ok(self.url + path, self.headers)

        wait_for(ok, timeout, f"{self.name} {path}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        os.unlink(self.log.name)


def start_stub(
    role: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    token: str | None = None,
    token_delay: float = 0.0,
    prefill_delay: float = 0.0,
) -> Proc:
    port = port or free_port()
    args = [
        sys.executable,
        str(STUB),
        "--role",
        role,
        "--host",
        host,
        "--port",
        str(port),
        "--token-delay",
        str(token_delay),
        "--prefill-delay",
        str(prefill_delay),
    ]
    if token:
        args += ["--token", token]
    headers = {"x-pdserve-token": token} if token else None
    return Proc(f"stub-{role}-{port}", args, f"http://{host}:{port}", headers)


def start_router(extra: list[str], port: int | None = None) -> Proc:
    port = port or free_port()
    args = [
        sys.executable,
        "-m",
        "router.main",
        "--port",
        str(port),
        "--health-interval",
        "0.3",
        "--log-level",
        "warning",
        *extra,
    ]
    return Proc(f"router-{port}", args, f"http://127.0.0.1:{port}")


def control(stub: Proc, mode: str) -> None:
    httpx.post(stub.url + "/_control", json={"mode": mode}, timeout=5.0).raise_for_status()


def stub_state(stub: Proc) -> dict:
    return httpx.get(stub.url + "/_state", timeout=5.0).json()
