"""Worker selection policies, one instance per role.

Contract: `pick(candidates, prefix)` gets a non-empty list of eligible workers and the request's
prompt prefix (a string; may be empty) and returns one of them. Callers remove workers that already
failed this request before calling, and fall back to the full list if nothing is left.

- round_robin   rotates through the candidates.
- least_load    fewest outstanding requests, ties by fewest outstanding tokens, then rotation.
- cache_aware   an approximate per-worker prefix tree of the prompts routed so far
                (router/prefix_index.py). The worker whose tree holds the longest prefix of the prompt
                wins when that prefix is at least `threshold` of the prompt; otherwise the least
                loaded worker. Ties (several with the best score, or no winner): the fewest outstanding
                requests, then the fewest tokens held (`held`: the most room for a new prefix; a worker
                with KV events counts its device blocks x block size in the KV index, one without its
                tree's characters / CHARS_PER_TOKEN), then the URL. Load guard: when the winner's
                outstanding requests exceed the least loaded one's by both `abs_threshold` and
                `rel_threshold`x, least_load decides, so one hot prefix cannot pin a worker. The picked
                worker's tree then holds the prompt.
                A request with a `routing_key` is routed by a digest of the key instead of its
                prompt (router.protocol), so requests sharing a key stay on one worker.
                With a KV index (router/kv_index.py, `--kv-events auto`): when every candidate publishes
                KV events, the pick is the least work before the request's first token (`by_cost`): the
                worker's outstanding tokens plus the prompt tokens it would compute (its leading pages on
                the device are free, those after them on its host tier count 1 - HOST_WEIGHT), ties as
                above, then the same load guard. Dynamo's cost (overlap-weighted prefill blocks plus the
                worker's active blocks) in tokens; measured against the threshold rule in docs/benchmarks.md.
                With a mix, a worker that publishes events is scored by what it really holds (the same
                pages as a share of the prompt's tokens) against the same `threshold`. That needs the request's token
                ids (`exact`): /generate `input_ids` and token-id completions carry them; text and chat
                prompts get them from the router's tokenizer (router/prompt_ids.py, the frontends'
                tokenization) once it is loaded. A request without them (no tokenizer, images, tools, a
                `routing_key`) and a worker without events are scored by the approximate tree.
"""

from __future__ import annotations

import itertools
from typing import Protocol

from router.kv_index import ExactPrompt, KVIndex
from router.prefix_index import PrefixIndex
from router.protocol import CHARS_PER_TOKEN
from router.registry import Worker

HOST_WEIGHT = 0.5  # a page on the host tier: loaded back, not recomputed, but not free either


class Policy(Protocol):
    def pick(self, candidates: list[Worker], prefix: str, exact: ExactPrompt | None = None) -> Worker: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Worker], prefix: str, exact: ExactPrompt | None = None) -> Worker:
        ordered = sorted(candidates, key=lambda w: w.url)
        return ordered[next(self._counter) % len(ordered)]


class LeastLoad:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def pick(self, candidates: list[Worker], prefix: str, exact: ExactPrompt | None = None) -> Worker:
        best = min((w.outstanding_requests, w.outstanding_tokens) for w in candidates)
        tied = sorted(
            (w for w in candidates if (w.outstanding_requests, w.outstanding_tokens) == best),
            key=lambda w: w.url,
        )
        return tied[next(self._counter) % len(tied)]


class CacheAware:
    def __init__(self, index: PrefixIndex, threshold: float = 0.3, abs_threshold: int = 4, rel_threshold: float = 1.5,
                 kv: KVIndex | None = None, predicts: bool = False) -> None:
        self.index = index
        self.kv = kv
        self.predicts = predicts  # count the index's predicted cached tokens of each pick (the prefill role's)
        self._threshold = threshold
        self._abs = abs_threshold
        self._rel = rel_threshold
        self._fallback = LeastLoad()
        self._predicted: dict[str, int] = {}  # url -> device tokens the KV index predicts (this pick)
        self._memo: dict[tuple[int, str], list[int]] = {}  # (page size, namespace) -> the request's hashes (this pick)

    def share(self, w: Worker, chain: list[int], exact: ExactPrompt | None) -> float:
        """The share of the prompt `w` holds: from its KV events when it has them and `exact` is given, else
        from the approximate tree."""
        if exact is not None and exact.token_ids and self.kv is not None:
            got = self.kv.prefix_of(w.url, exact, w.loras, self._memo)
            if got is not None:
                device, host, size = got
                self._predicted[w.url] = device * size
                return (device + HOST_WEIGHT * host) * size / len(exact.token_ids)
        return self.index.matched(w.url, chain) / len(chain) if chain else 0.0

    def predicted(self, url: str) -> int:
        """The prompt tokens the KV index predicted the last pick's worker at `url` holds on its device (0: none,
        or no index): the proxy leases a prefill for the tokens it computes, so `outstanding_tokens` is queued
        work, not queued prompt length (a queue of cached turns is short)."""
        return self._predicted.get(url, 0)

    def held(self, w: Worker) -> int:
        """Prompt tokens `w` holds, the tie-break's measure (fewer: more room for a new prefix): its device
        blocks x block size when it publishes KV events, else its approximate tree's characters / CHARS_PER_TOKEN."""
        tokens = self.kv.held_tokens(w.url) if self.kv is not None else None
        return tokens if tokens is not None else self.index.size(w.url) * self.index.block_chars // CHARS_PER_TOKEN

    def by_cost(self, candidates: list[Worker], exact: ExactPrompt) -> Worker | None:
        """Every candidate publishes KV events: the worker with the least work before this request's first
        token, its outstanding tokens plus the prompt tokens it would compute (a host page costs 1 - HOST_WEIGHT
        of a computed one). Ties: fewest outstanding requests, then fewest tokens held, then the URL. None when
        some candidate has no events (the threshold rule decides)."""
        n = len(exact.token_ids)
        costs = []
        for w in candidates:
            got = self.kv.prefix_of(w.url, exact, w.loras, self._memo) if self.kv is not None else None
            if got is None:
                return None
            device, host, size = got
            self._predicted[w.url] = device * size
            cached = min(n, (device + HOST_WEIGHT * host) * size)
            costs.append((w.outstanding_tokens + n - cached, w.outstanding_requests, self.held(w), w.url, w))
        return min(costs, key=lambda c: c[:4])[4]

    def by_cache(self, candidates: list[Worker], chain: list[int], exact: ExactPrompt | None = None) -> Worker:
        scored = [(self.share(w, chain, exact), w) for w in candidates]
        best = max(n for n, _ in scored)
        tied = [w for n, w in scored if n == best] if best and best >= self._threshold else candidates
        if len(tied) == 1:
            return tied[0]
        return min(tied, key=lambda w: (w.outstanding_requests, self.held(w), w.url))

    def pick(self, candidates: list[Worker], prefix: str, exact: ExactPrompt | None = None) -> Worker:
        chain = self.index.chain(prefix)
        self._predicted.clear()
        self._memo.clear()
        chosen = self.by_cost(candidates, exact) if exact is not None and exact.token_ids else None
        if chosen is None:
            chosen = self.by_cache(candidates, chain, exact)
        least = min(w.outstanding_requests for w in candidates)
        load = chosen.outstanding_requests
        if load - least > self._abs and load > least * self._rel:
            chosen = self._fallback.pick(candidates, prefix)
        self.index.insert(chosen.url, chain)
        if self.kv is not None and self.predicts and chosen.url in self._predicted:
            self.kv.record_predicted(chosen.url, self._predicted[chosen.url])
        if self.kv is not None and exact is not None and exact.token_ids:
            self.kv.record_routed(chosen.url, exact, chosen.loras, self._memo)  # held there once its prefill runs
        return chosen


def make_policy(
    name: str,
    cache_threshold: float = 0.3,
    abs_threshold: int = 4,
    rel_threshold: float = 1.5,
    index: PrefixIndex | None = None,
    kv: KVIndex | None = None,
    predicts: bool = False,
) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_load":
        return LeastLoad()
    if name == "cache_aware":
        return CacheAware(index or PrefixIndex(), cache_threshold, abs_threshold, rel_threshold, kv, predicts)
    raise ValueError(f"unknown policy {name!r}")
