"""The watchdog: a request that makes no progress for `--watchdog-timeout` seconds while its worker is
alive is ended with a 503 naming the stage it was stuck in, counted (pdserve_worker_watchdog_ended_total)
and logged once.

No hook on the hot path: once a second the worker loop asks its role for `progress()`, one
`Progress(req, stage, mark)` per request it holds, where `mark` is anything that changes whenever that
request moves (its computed tokens, its output tokens, the KV pages landed for it). A request waiting
in a queue moves while its worker does: its mark is the worker's own (tokens computed, transfers
ended), so a long queue behind busy requests is never "stuck", and a queue that nothing drains is. A
request whose (stage, mark) stays the same longer than the timeout is ended by `role.fail(req, why)`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.request import Req

log = logging.getLogger("pdserve.watchdog")

# the stages roles name (the error message, the log line and docs/reliability.md use these words)
QUEUED = "queued for memory or a batch slot"
RETRACTED = "retracted to host memory, waiting to be reloaded"
PREFILL = "computing the prompt"
WAITING_DECODE = "waiting for the decode to take it"
SENDING_KV = "sending KV to the decode"
WAITING_KV = "waiting for KV from the prefill"
DECODING = "decoding"


class Progress(NamedTuple):
    req: Req
    stage: str
    mark: Hashable  # changes whenever the request (or, queued, its worker) moves


@dataclass
class Watchdog:
    """Checks a role's requests at most every `every_s` seconds (0 timeout: off)."""

    timeout_s: float
    every_s: float = 1.0
    ended: int = 0
    by_stage: dict[str, int] = field(default_factory=dict)
    _seen: dict[tuple[int, str], tuple[str, Hashable, float]] = field(default_factory=dict)
    _next: float = 0.0

    def check(self, progress: Callable[[], Iterable[Progress]], fail: Callable[[Req, str], None],
              now: float) -> int:
        """Look at `progress()`; end (through `fail`) each request whose stage and mark have not changed
        for longer than the timeout. Returns how many were ended."""
        if not self.timeout_s or now < self._next:
            return 0
        self._next = now + min(self.every_s, self.timeout_s / 4)
        seen: dict[tuple[int, str], tuple[str, Hashable, float]] = {}
        stuck: list[tuple[Req, str, float]] = []
        for req, stage, mark in progress():
            key = (id(req), req.rid)
            old = self._seen.get(key)
            since = old[2] if old is not None and old[:2] == (stage, mark) else now
            seen[key] = (stage, mark, since)
            if now - since > self.timeout_s:
                stuck.append((req, stage, now - since))
        self._seen = seen
        for req, stage, idle in stuck:
            why = (f"no progress for {idle:.0f} s while {stage}; ended by the watchdog "
                   f"(--watchdog-timeout {self.timeout_s:g})")
            log.warning("rid=%s: %s", req.rid, why)  # once: the request ends here
            fail(req, why)
            self._seen.pop((id(req), req.rid), None)
            self.ended += 1
            self.by_stage[stage] = self.by_stage.get(stage, 0) + 1
        return len(stuck)


def scheduler_progress(waiting: Iterable[Req], running: Iterable[Req], worker: Hashable) -> Iterable[Progress]:
    """A scheduler's requests: queued ones (new, mid-prompt or retracted) move with the worker
    (`worker`: its mark), running ones with their own output."""
    for r in waiting:
        stage = RETRACTED if r.is_retracted else PREFILL if r.kv.kv_len > r.kv.cached_tokens else QUEUED
        yield Progress(r, stage, worker)
    for r in running:
        yield Progress(r, DECODING, r.num_output_tokens)
