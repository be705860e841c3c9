"""Worker selection policies, one instance per role.

Contract: `pick(candidates, prefix)` gets a non-empty list of eligible workers and the request's
prompt prefix (a string; may be empty) and returns one of them. Callers remove workers that already
failed this request before calling, and fall back to the full list if nothing is left.

- round_robin   rotates through the candidates.
- least_load    fewest outstanding requests, ties by fewest outstanding tokens, then rotation.
- cache_aware   rendezvous hash of the prompt prefix -> a stable worker per prefix (so requests sharing
                a prefix land where their prefix is cached), unless that worker's outstanding requests
                exceed the least loaded one's by both `abs_threshold` and `rel_threshold`x; then
                least_load. Rendezvous hashing moves only the removed worker's prefixes when the
                worker set changes.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Protocol

from router.registry import Worker


class Policy(Protocol):
    def pick(self, candidates: list[Worker], prefix: str) -> Worker: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Worker], prefix: str) -> Worker:
        ordered = sorted(candidates, key=lambda w: w.url)
        return ordered[next(self._counter) % len(ordered)]


class LeastLoad:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Worker], prefix: str) -> Worker:
        best = min((w.outstanding_requests, w.outstanding_tokens) for w in candidates)
        tied = sorted(
            (w for w in candidates if (w.outstanding_requests, w.outstanding_tokens) == best),
            key=lambda w: w.url,
        )
        return tied[next(self._counter) % len(tied)]


def _score(prefix: str, url: str) -> int:
    digest = hashlib.blake2b(f"{url}\0{prefix}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class CacheAware:
    def __init__(self, prefix_chars: int, abs_threshold: int, rel_threshold: float) -> None:
        self._prefix_chars = prefix_chars
        self._abs = abs_threshold
        self._rel = rel_threshold
        self._fallback = LeastLoad()

    def affinity(self, candidates: list[Worker], prefix: str) -> Worker:
        key = prefix[: self._prefix_chars]
        return max(candidates, key=lambda w: _score(key, w.url))

    def pick(self, candidates: list[Worker], prefix: str) -> Worker:
        if not prefix:
            return self._fallback.pick(candidates, prefix)
        chosen = self.affinity(candidates, prefix)
        least = min(w.outstanding_requests for w in candidates)
        load = chosen.outstanding_requests
        if load - least > self._abs and load > least * self._rel:
            return self._fallback.pick(candidates, prefix)
        return chosen


def make_policy(
    name: str, prefix_chars: int = 256, abs_threshold: int = 4, rel_threshold: float = 1.5
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(prefix_chars, abs_threshold, rel_threshold)
    raise ValueError(f"unknown policy {name!r}")
