"""An approximate per-worker prefix tree of the prompts the router sent, for `cache_aware`.

The router cannot see a worker's KV cache; it remembers what it routed there. A prompt (its text,
or its token ids joined by commas) is cut into blocks of `block_chars` characters, and block i is
named by a chain hash of blocks 0..i, so equal names mean equal prefixes: the set of names a worker
holds is a radix tree over blocks, stored flat. `matched(url, chain)` walks the request's chain until
the worker lacks a block: the length of the longest prefix that worker has seen.

Each worker's blocks live in an LRU of at most `max_chars // block_chars` entries. A prompt's blocks are touched
deepest first, so its first block is the most recent: eviction drops leaves before their parents,
as a radix cache evicts. Trees of workers not picked for `idle_s` are dropped (a pod replaced in
Kubernetes comes back under a new URL).
"""

from __future__ import annotations

import time
from collections import OrderedDict


class PrefixIndex:
    def __init__(self, max_chars: int = 4_000_000, block_chars: int = 64, idle_s: float = 600.0) -> None:
        if block_chars < 1 or max_chars < block_chars:
            raise ValueError("block_chars must be >= 1 and max_chars >= block_chars")
        self.block_chars = block_chars
        self.max_blocks = max_chars // block_chars
        self.idle_s = idle_s
        self._trees: dict[str, OrderedDict[int, None]] = {}
        self._last_pick: dict[str, float] = {}

    def chain(self, prompt: str) -> list[int]:
        """Chain hashes of the prompt's full blocks (a partial last block is not named)."""
        b, out, h = self.block_chars, [], 0
        for start in range(0, len(prompt) - b + 1, b):
            h = hash((h, prompt[start : start + b]))
            out.append(h)
        return out

    def matched(self, url: str, chain: list[int]) -> int:
        """How many leading blocks of `chain` the worker at `url` was sent before."""
        tree = self._trees.get(url)
        if not tree:
            return 0
        n = 0
        for h in chain:
            if h not in tree:
                break
            n += 1
        return n

    def insert(self, url: str, chain: list[int], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        tree = self._trees.setdefault(url, OrderedDict())
        for h in reversed(chain):  # deepest first: the root-most block ends up most recent
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.max_blocks:
            tree.popitem(last=False)
        self._last_pick[url] = now
        self._drop_idle(now)

    def size(self, url: str) -> int:
        return len(self._trees.get(url, ()))

    def forget(self, url: str) -> None:
        self._trees.pop(url, None)
        self._last_pick.pop(url, None)

    def _drop_idle(self, now: float) -> None:
        for url, t in list(self._last_pick.items()):
            if now - t > self.idle_s:
                self.forget(url)
