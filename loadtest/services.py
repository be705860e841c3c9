"""Start pdserve services as local processes for an experiment, and stop every one of them after.

    with LocalServices(log_dir) as svc:
        svc.spawn("decode", [sys.executable, "-m", "pdserve", "decode", ...])
        svc.wait_healthy(["http://127.0.0.1:30001/health"], timeout_s=300)

Each process runs in its own session (process group); teardown sends SIGTERM to each group, then
SIGKILL after a grace period. SIGTERM to the experiment itself becomes SystemExit so teardown runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
SERVICE_ENV = {"PYTHONPATH": str(REPO), "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n",
               "PYTHONUNBUFFERED": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServices:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []

    def __enter__(self) -> LocalServices:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._old = signal.signal(signal.SIGTERM, _raise_exit)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            signal.signal(signal.SIGTERM, self._old)

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        if name in self.procs:
            raise ValueError(f"a service called {name} is already running")
        logf = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop_all)
        self._logs.append(logf)
        p = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                             env=os.environ | SERVICE_ENV | (env or {}))
        self.procs[name] = p
        return p

    def wait_healthy(self, urls: list[str], timeout_s: float) -> None:
        """Poll each URL until 200; RuntimeError naming the log when a process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}; see {self.log_dir}/{name}.log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout_s} s: {pending} (logs in {self.log_dir})")
            try:
                if httpx.get(pending[0], timeout=2).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # poll interval while services load the model

    def stop_all(self, grace_s: float = 10.0) -> None:
        for p in self.procs.values():
            _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(p, signal.SIGKILL)
                p.wait(timeout=5)
        self.procs.clear()
        for f in self._logs:
            f.close()
        self._logs.clear()


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _signal_group(p: subprocess.Popen, sig: int) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
