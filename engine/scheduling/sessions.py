"""Sessions on the worker (SGLang's `open_session` / `session_params`): the KV of a session's last
finished request stays in the prefix cache, pinned, so the session's next request (whose prompt is
that request's prompt and output plus the new tokens: the frontend builds it, service/sessions.py)
computes only its new tokens.

A pin is a lock on the prefix-cache node of the request's cached pages (engine.kvcache.radix_cache: every
page on the path is then unevictable). One pin per session, moved to each request of the session
as it finishes normally (an error or abort keeps the previous one). A pin is dropped when its session
closes (`unpin`), when the session has been idle `timeout_s` (`expire`), and, oldest first, whenever a
scheduler step computes nothing while requests wait (`relieve`): pinned pages never keep a request
from running. Without a prefix cache (disabled, or a sliding-window model) nothing is pinned and
sessions still give the same tokens: the prompt is recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from engine.kvcache.kv_manager import KVManager
from engine.kvcache.radix_cache import Node
from engine.request import FinishReason, Req


@dataclass
class Pin:
    node: Node
    used: float  # last time a request of the session finished
    pages: int


class SessionPins:
    """The pins of one worker's sessions (read `pinned_pages` for stats)."""

    def __init__(self, kv: KVManager, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.kv, self.timeout_s, self.clock = kv, timeout_s, clock
        self.pins: dict[str, Pin] = {}

    def __len__(self) -> int:
        return len(self.pins)

    @property
    def pinned_pages(self) -> int:
        return sum(p.pages for p in self.pins.values())

    def finished(self, reqs: Iterable[Req]) -> None:
        """Pin the KV of every session request among `reqs` that ended normally (already released:
        its full pages are in the tree), replacing its session's previous pin."""
        cache = self.kv.cache
        for r in reqs:
            if not r.session_id or not r.finished or r.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                continue
            if cache is None:
                continue
            hit = cache.match(r.token_ids, r.kv.kv_len or len(r.token_ids), r.cache_namespace)
            self.unpin(r.session_id)
            if hit.pages:
                cache.lock(hit.node)
                self.pins[r.session_id] = Pin(hit.node, self.clock(), len(hit.pages))

    def unpin(self, session_id: str) -> bool:
        """Drop a session's pin (its pages stay cached, evictable); False when it had none."""
        pin = self.pins.pop(session_id, None)
        if pin is None or self.kv.cache is None:
            return False
        self.kv.cache.unlock(pin.node)
        return True

    def expire(self) -> int:
        """Drop the pins of sessions idle for timeout_s; returns how many."""
        now = self.clock()
        old = [sid for sid, p in self.pins.items() if now - p.used >= self.timeout_s]
        for sid in old:
            self.unpin(sid)
        return len(old)

    def relieve(self) -> bool:
        """Drop the oldest pin (a step computed nothing while requests wait); False when none."""
        if not self.pins:
            return False
        return self.unpin(min(self.pins, key=lambda sid: self.pins[sid].used))
