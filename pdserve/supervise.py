"""Restart policy of `pdserve up`: a child that exits is started again with the same argv.

    sup = Supervisor("on-failure", children, log=print)
    while True: sup.poll(time.monotonic()); time.sleep(0.5)   # `children` is updated in place

on-failure: a child that exits with a non-zero status (a signal counts) is restarted after a
backoff of 1, 2, 4, ... s (capped at BACKOFF_MAX_S); a child that then stays up for STABLE_S
starts again at 1 s. A child that exits 0 stops on purpose (a drained service) and stays down.
never: the first exit is final (`poll` returns it and `pdserve up` stops everything, as before).

A restarted worker keeps its ports, so the router, which ejected it after failed health probes,
re-admits it at the same URL once it answers /health again. Every exit and restart is logged.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from common.procs import Child

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_S = 60.0
POLICIES = ("on-failure", "never")


@dataclass
class _Slot:
    started: float
    backoff: float = BACKOFF_MIN_S
    restarts: int = 0
    due: float | None = None  # when the pending restart runs


class Supervisor:
    def __init__(self, policy: str, children: list[Child], log: Callable[[str], object],
                 spawn: Callable[[Child], Child] | None = None, now: float = 0.0) -> None:
        if policy not in POLICIES:
            raise ValueError(f"restart policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.children, self._log = policy, children, log
        self._spawn = spawn or _respawn
        self._slots = {c.name: _Slot(now) for c in children}

    def restarts(self, name: str) -> int:
        return self._slots[name].restarts

    def poll(self, now: float) -> Child | None:
        """Reap exits and run due restarts; returns a child whose exit is final under `never`."""
        for i, child in enumerate(self.children):
            slot = self._slots[child.name]
            code = child.popen.poll()
            if code is None:
                if now - slot.started >= STABLE_S:
                    slot.backoff = BACKOFF_MIN_S
                continue
            if self.policy == "never":
                return child
            if code == 0:
                if slot.due is None:
                    slot.due = float("inf")  # stays down; said once
                    self._log(f"{child.name} (pid {child.pid}) exited with 0; not restarted")
                continue
            if slot.due is None:
                _kill_leftovers(child)
                slot.due = now + slot.backoff
                self._log(f"{child.name} (pid {child.pid}) exited with {code}; restarting in "
                          f"{slot.backoff:g}s (log {child.log_path})")
                continue
            if now >= slot.due:
                self.children[i] = self._spawn(child)
                slot.restarts += 1
                slot.started, slot.due = now, None
                slot.backoff = min(BACKOFF_MAX_S, slot.backoff * 2)
                self._log(f"restarted {child.name} (restart {slot.restarts}): pid {self.children[i].pid}")
        return None


def _respawn(old: Child) -> Child:
    return Child(old.name, old.argv, old.log_path, url=old.url)


def _kill_leftovers(child: Child) -> None:
    """SIGKILL what is left of a dead child's process group (a service's worker process whose
    frontend was killed), so the restart finds its ports and memory free."""
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
