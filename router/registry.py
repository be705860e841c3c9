"""Worker registry: the router's view of its prefill, decode and encoder workers.

A worker is *eligible* for new requests when it is healthy (its last probes passed, fewer than
`health_failures` failures in a row) and, for a prefill or an encoder, its bootstrap port is known. Request failures
never eject the last eligible worker of a role: with no alternative an ejection only turns every
request into a 503, so health probes alone decide about that one. Load (outstanding requests and
estimated tokens) is counted here by the proxy through `lease`. Everything runs on the router's
single event loop, so no locks are needed; `wait_eligible` lets a request wait for a worker.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from router.config import BOOTSTRAP_ROLES, WorkerSpec

log = logging.getLogger("router.registry")


@dataclass
class Worker:
    spec: WorkerSpec
    bootstrap_host: str = ""  # host peers use to reach this prefill's (encoder's) bootstrap server
    bootstrap_port: int | None = None
    healthy: bool = False  # becomes True after the first passing probe
    consecutive_failures: int = 0
    outstanding_requests: int = 0
    outstanding_tokens: int = 0
    served_model_name: str = ""
    loras: frozenset[str] = frozenset()  # LoRA adapters the worker holds (its /health; router/lora.py)
    source: str = "static"  # static | admin | k8s
    ejections: int = field(default=0)

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> str:
        return self.spec.role

    @property
    def eligible(self) -> bool:
        return self.healthy and (self.role not in BOOTSTRAP_ROLES or self.bootstrap_port is not None)

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "eligible": self.eligible,
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "outstanding_requests": self.outstanding_requests,
            "outstanding_tokens": self.outstanding_tokens,
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.ejections,
            "source": self.source,
        }


class Registry:
    """Workers by URL. `on_eject(worker)` is called once per healthy -> ejected transition, `on_remove(worker)`
    when a worker leaves the registry."""

    def __init__(self, health_failures: int, on_eject=None, on_admit=None, on_remove=None) -> None:
        self._workers: dict[str, Worker] = {}
        self._health_failures = health_failures
        self._on_eject = on_eject
        self._on_admit = on_admit
        self._on_remove = on_remove
        self._changed: asyncio.Event | None = None  # set (then replaced) on every success, for waiters

    def add(self, spec: WorkerSpec, source: str = "static") -> Worker:
        """Add a worker (not yet healthy: the next probe admits it). Re-adding the same spec is a no-op;
        a different spec at the same URL replaces it."""
        old = self._workers.get(spec.url)
        if old is not None and old.spec == spec:
            return old
        w = Worker(spec=spec, bootstrap_host=spec.host, bootstrap_port=spec.bootstrap_port, source=source)
        self._workers[spec.url] = w
        log.info("worker added: %s %s (%s)", spec.role, spec.url, source)
        return w

    def remove(self, url: str) -> Worker | None:
        w = self._workers.pop(url.rstrip("/"), None)
        if w is not None:
            log.info("worker removed: %s %s", w.role, w.url)
            if self._on_remove:
                self._on_remove(w)
        return w

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url.rstrip("/"))

    def all(self, role: str | None = None) -> list[Worker]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def eligible(self, role: str) -> list[Worker]:
        return [w for w in self._workers.values() if w.role == role and w.eligible]

    async def wait_eligible(self, role: str, timeout_s: float) -> list[Worker]:
        """The eligible workers of `role`, waiting up to `timeout_s` for one to appear; [] if none did."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not (eligible := self.eligible(role)):
            left = deadline - loop.time()
            if left <= 0:
                return []
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return []
        return eligible

    def record_success(self, w: Worker) -> None:
        w.consecutive_failures = 0
        if not w.healthy:
            w.healthy = True
            log.info("worker admitted: %s %s", w.role, w.url)
            if self._on_admit:
                self._on_admit(w)
        if self._changed is not None:  # someone waits in wait_eligible: let it look again
            self._changed.set()
            self._changed = None

    def record_failure(self, w: Worker, reason: str, probe: bool = False) -> None:
        """A failed health probe (`probe`) or request. At `health_failures` in a row the worker is
        ejected, except that request failures alone never eject the last eligible worker of its role."""
        w.consecutive_failures += 1
        if not probe and self.eligible(w.role) == [w]:
            if w.consecutive_failures == self._health_failures:
                log.warning("not ejecting %s %s after %d failed requests: it is the last eligible %s "
                            "(health probes decide; last: %s)", w.role, w.url, w.consecutive_failures,
                            w.role, reason)
            return
        if w.healthy and w.consecutive_failures >= self._health_failures:
            w.healthy = False
            w.ejections += 1
            log.warning(
                "worker ejected: %s %s after %d failures (last: %s)",
                w.role,
                w.url,
                w.consecutive_failures,
                reason,
            )
            if self._on_eject:
                self._on_eject(w)

    def lease(self, w: Worker, tokens: int) -> Lease:
        """Count one outstanding request of `tokens` estimated tokens on `w` until `release()`."""
        return Lease(w, tokens)


class Lease:
    """One request's share of a worker's load; `release` is idempotent."""

    def __init__(self, w: Worker, tokens: int) -> None:
        self.worker = w
        self.tokens = tokens
        self._held = True
        w.outstanding_requests += 1
        w.outstanding_tokens += tokens

    def release(self) -> None:
        if self._held:
            self._held = False
            self.worker.outstanding_requests -= 1
            self.worker.outstanding_tokens -= self.tokens
