"""Start pdserve services as local processes for an experiment, and stop every one of them after.

    with LocalServices(log_dir) as svc:
        svc.spawn("decode", [sys.executable, "-m", "pdserve", "decode", ...])
        svc.wait_healthy(["http://127.0.0.1:30001/health"], timeout_s=300)

The processes are common.procs children (own session, log per name); teardown stops them all
(SIGTERM, SIGKILL after a grace period). SIGTERM to the experiment itself becomes SystemExit so
teardown runs.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from common.procs import Child, http_ok, stop_all

REPO = Path(__file__).resolve().parent.parent
SERVICE_ENV = {"PYTHONPATH": str(REPO), "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n",
               "PYTHONUNBUFFERED": "1"}
# decode flags for an experiment about the PD path itself (transfers, faults mid-prefill, prefill-side
# caches): every prompt is disaggregated, none prefilled on the decode (its default threshold is 256)
ALWAYS_PD = ("--local-prefill-threshold", "0")


class LocalServices:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = Path(log_dir)
        self.procs: dict[str, Child] = {}

    def __enter__(self) -> LocalServices:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._old = signal.signal(signal.SIGTERM, _raise_exit)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            signal.signal(signal.SIGTERM, self._old)

    def spawn(self, name: str, argv: list[str], env: dict | None = None) -> Child:
        if name in self.procs:
            raise ValueError(f"a service called {name} is already running")
        child = Child(name, argv, self.log_dir / f"{name}.log", env={**SERVICE_ENV, **(env or {})}, cwd=REPO)
        self.procs[name] = child
        return child

    def wait_healthy(self, urls: list[str], timeout_s: float) -> None:
        """Poll each URL until 200; RuntimeError naming the log when a process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            for name, c in self.procs.items():
                if not c.alive():
                    raise RuntimeError(f"{name} exited with {c.popen.returncode}; see {c.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not healthy after {timeout_s} s: {pending} (logs in {self.log_dir})")
            if http_ok(pending[0]):
                pending.pop(0)
                continue
            time.sleep(0.5)  # poll interval while services load the model

    def stop_all(self, grace_s: float = 10.0) -> None:
        stop_all(list(self.procs.values()), grace_s)
        self.procs.clear()


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
