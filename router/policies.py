"""Worker selection policies, one instance per role.

Contract: `pick(candidates, prefix)` gets a non-empty list of eligible workers and the request's
prompt prefix (a string; may be empty) and returns one of them. Callers remove workers that already
failed this request before calling, and fall back to the full list if nothing is left.

- round_robin   rotates through the candidates.
- least_load    fewest outstanding requests, ties by fewest outstanding tokens, then rotation.
- cache_aware   an approximate per-worker prefix tree of the prompts routed so far
                (router/prefix_index.py). The worker whose tree holds the longest prefix of the prompt
                wins when that prefix is at least `threshold` of the prompt (ties: least loaded);
                otherwise the least loaded worker, ties broken by the smallest tree (the most room for
                a new prefix). Load guard: when the winner's outstanding requests exceed the least
                loaded one's by both `abs_threshold` and `rel_threshold`x, least_load decides, so
                one hot prefix cannot pin a worker. The picked worker's tree then holds the prompt.
                A request with a `routing_key` is routed by a digest of the key instead of its
                prompt (router.protocol), so requests sharing a key stay on one worker.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from router.prefix_index import PrefixIndex
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


class CacheAware:
    def __init__(
        self, index: PrefixIndex, threshold: float = 0.3, abs_threshold: int = 4, rel_threshold: float = 1.5
    ) -> None:
        self.index = index
        self._threshold = threshold
        self._abs = abs_threshold
        self._rel = rel_threshold
        self._fallback = LeastLoad()

    def by_cache(self, candidates: list[Worker], chain: list[int]) -> Worker:
        if chain:
            scored = [(self.index.matched(w.url, chain), w) for w in candidates]
            best = max(n for n, _ in scored)
            if best and best >= self._threshold * len(chain):
                return min((w for n, w in scored if n == best), key=lambda w: (w.outstanding_requests, w.url))
        return min(candidates, key=lambda w: (w.outstanding_requests, self.index.size(w.url), w.url))

    def pick(self, candidates: list[Worker], prefix: str) -> Worker:
        chain = self.index.chain(prefix)
        chosen = self.by_cache(candidates, chain)
        least = min(w.outstanding_requests for w in candidates)
        load = chosen.outstanding_requests
        if load - least > self._abs and load > least * self._rel:
            chosen = self._fallback.pick(candidates, prefix)
        self.index.insert(chosen.url, chain)
        return chosen


def make_policy(
    name: str,
    cache_threshold: float = 0.3,
    abs_threshold: int = 4,
    rel_threshold: float = 1.5,
    index: PrefixIndex | None = None,
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(index or PrefixIndex(), cache_threshold, abs_threshold, rel_threshold)
    raise ValueError(f"unknown policy {name!r}")
