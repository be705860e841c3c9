"""Process helpers for router tests: free ports, stub workers and routers as real subprocesses,
polling with deadlines (never fixed sleeps)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import httpx

from common.procs import Child, free_port, http_ok, wait_until

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(__file__).with_name("stub_worker.py")
__all__ = ["ROOT", "STUB", "Proc", "free_port", "http_ok", "wait_for"]


def wait_for(cond, timeout: float, what: str, interval: float = 0.05):  # noqa: ANN001, ANN201
    return wait_until(cond, timeout, what, interval)


class Proc(Child):
    """A child process (common.procs.Child) with its output in a temp file, removed on stop."""

    def __init__(self, name: str, args: list[str], url: str, headers: dict | None = None,
                 env: dict | None = None) -> None:
        self.args, self.headers = args, headers or {}
        log = tempfile.NamedTemporaryFile(prefix=f"{name}-", suffix=".log", delete=False)
        log.close()
        super().__init__(name, args, log.name, url=url, env={"PYTHONPATH": str(ROOT), **(env or {})}, cwd=ROOT)

    def wait_healthy(self, timeout: float = 30.0, path: str = "/health") -> None:
        wait_until(lambda: self.healthy(self.headers, path), timeout, f"{self.name} {path}")

    def stop(self, grace: float = 10.0) -> int | None:
        code = super().stop(grace)
        os.unlink(self.log_path)
        return code


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
