"""Prefix cache: a radix tree over token ids at page granularity, holding KV page ids.

Each edge is one full page of token ids (`page_size` ids); its node holds the device page with
those tokens' KV. A prefix is shareable page by page; the partial last page of a sequence is never
cached (the next request recomputes it). Pure Python: no torch, testable alone.

Namespaces: every lookup and insert names a `namespace` (Req.cache_namespace: the cache salt and
the LoRA adapter). KV computed under one namespace never serves another: a prefix's first page key
carries its namespace, so each namespace is its own subtree under the root ("" is today's tree).

Ownership: a page in the tree belongs to the tree; a request that matched a prefix uses the tree's
pages read-only and holds a lock on the deepest matched node (`lock`: +1 on every node of the path).
A node with lock_ref 0 has only unlocked descendants, so every unlocked page is evictable by
removing leaves, least recently used first (`evict`). Counters kept honest at every change:
`cached_pages` (all pages in the tree) and `evictable_pages` (lock_ref 0).

Tiers (engine/kvcache/hicache, HiRadixCache): a node may also hold a host page (`host` >= 0) and may lose
its device page (`page` -1): it then stays in the tree, reachable by `match_len`, and `match` stops
at it (only device pages are handed out). Device residence is prefix-closed (a node on the device
has its parent on the device), and `insert` gives a host-only node the inserting request's device
page. Without tiers every node holds a device page and `host` stays -1.

State snapshots (hybrid recurrent models, engine.kvcache.kv_manager): a node may also hold a recurrent-state
slot (`state` >= 0), a copy of the state of a sequence of exactly its prefix's tokens. `match(need_state=True)`
stops at the deepest node of the matched path that holds one (a hybrid model can restart only there);
`attach_states` gives nodes the snapshots a finished request took. A snapshot is never locked (a request
that matched it took a copy), so any can be dropped alone (`evict_states`, least recently used first); a
node evicted takes its snapshot with it. Slots go back through `free_states`; `snapshots` counts them.

Events (engine/kvcache/events, docs/kv_events.md): with `events` set (a KVEventRecorder), every page the
tree gains or loses on a medium is reported (`_stored`, `_removed`: "GPU" here, "CPU" for the host tier)
and a flush that empties the tree reports it cleared.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import NamedTuple, Protocol


class Node:
    __slots__ = ("parent", "key", "page", "children", "lock_ref", "last_access", "host", "hash", "block_hash",
                 "state")

    def __init__(self, parent: Node | None, key: tuple, page: int) -> None:
        self.parent = parent
        self.key = key  # the page's token ids (a first page's: its namespace, then the ids)
        self.page = page  # device page holding their KV (0 for the root; -1: not on the device)
        self.children: dict[tuple, Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.host = -1  # host-tier page holding a copy (engine/kvcache/hicache; -1: none)
        self.hash: bytes | None = None  # chained page hash (disk tier key), computed on first use
        self.block_hash: int | None = None  # KV event block hash (engine/kvcache/events), set when first reported
        self.state = -1  # hybrid models: the state slot holding the recurrent state at this prefix's end (-1: none)


class Match(NamedTuple):
    pages: list[int]  # device pages of the matched prefix, in order
    node: Node  # deepest matched node (the root when nothing matched): what a request locks


class TreeEvents(Protocol):
    """Where a tree reports its changes (engine.kvcache.events.KVEventRecorder); calls must not block."""

    def stored(self, nodes: list[Node], medium: str) -> None: ...
    def removed(self, nodes: list[Node], medium: str) -> None: ...
    def cleared(self) -> None: ...


GPU, CPU = "GPU", "CPU"  # media of KV events: the device tier, the host tier (vLLM's names)


class RadixCache:
    """`free_pages(pages)` hands evicted pages back to the allocator, `free_states(slots)` dropped state
    snapshots back to the state pool (hybrid models); `events` (None: off) hears every change."""

    def __init__(self, page_size: int, free_pages: Callable[[list[int]], None],
                 free_states: Callable[[list[int]], None] | None = None) -> None:
        self.page_size = page_size
        self.free_pages = free_pages
        self.free_states = free_states
        self.snapshots = 0  # nodes holding a state snapshot (each one state slot)
        self.evicted_states = 0  # counter: snapshots dropped (alone or with their node) since start
        self.root = Node(None, (), 0)
        self.root.lock_ref = 1  # never evicted, never counted
        self.cached_pages = 0
        self.evictable_pages = 0
        self.evicted_pages = 0  # counter: pages evicted since start
        self._clock = itertools.count(1)
        self.events: TreeEvents | None = None

    def _stored(self, nodes: list[Node], medium: str = GPU) -> None:
        if self.events is not None and nodes:
            self.events.stored(nodes, medium)

    def _removed(self, nodes: list[Node], medium: str = GPU) -> None:
        if self.events is not None and nodes:
            self.events.removed(nodes, medium)

    # ---- lookup -------------------------------------------------------------------------------
    def _keys(self, ids: list[int], max_tokens: int, namespace: str = "") -> list[tuple]:
        ps = self.page_size
        n = min(len(ids), max_tokens) // ps
        keys: list[tuple] = [tuple(ids[i * ps : (i + 1) * ps]) for i in range(n)]
        if namespace and keys:
            keys[0] = (namespace, *keys[0])
        return keys

    def match(self, ids: list[int], max_tokens: int | None = None, namespace: str = "",
              need_state: bool = False) -> Match:
        """Longest cached page-aligned prefix of ids[:max_tokens] in `namespace`; touches the path
        (LRU). `need_state`: cut back to the deepest node of that path holding a state snapshot (the
        root, no pages, when none does)."""
        node, pages, now = self.root, [], next(self._clock)
        best = (0, self.root)  # (pages, node) of the deepest snapshot so far
        for key in self._keys(ids, len(ids) if max_tokens is None else max_tokens, namespace):
            child = node.children.get(key)
            if child is None or child.page < 0:
                break
            node = child
            node.last_access = now
            pages.append(node.page)
            if node.state >= 0:
                best = (len(pages), node)
        if need_state:
            return Match(pages[: best[0]], best[1])
        return Match(pages, node)

    def match_len(self, ids: list[int], max_tokens: int | None = None, namespace: str = "",
                  need_state: bool = False) -> int:
        """Tokens of ids[:max_tokens] a match would reuse (read-only: no LRU touch); with tiers,
        pages held on the host count too (a match loads them). `need_state`: up to the deepest
        snapshot only."""
        node, n, best = self.root, 0, 0
        for key in self._keys(ids, len(ids) if max_tokens is None else max_tokens, namespace):
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:
                break
            n += self.page_size
            if node.state >= 0:
                best = n
        return best if need_state else n

    # ---- locks --------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= 1
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += 1
            node = node.parent  # type: ignore[assignment]

    # ---- insert -------------------------------------------------------------------------------
    def insert(self, ids: list[int], pages: list[int], owned_from: int,
               namespace: str = "") -> tuple[Node, list[int]]:
        """Insert the full pages of `ids` (KV in `pages`, in order). The tree takes `pages[i]` for
        every page it did not hold; a page it already holds under another id is a duplicate and is
        returned for the caller to free, when i >= owned_from (pages before it are the tree's own,
        matched earlier). Returns (deepest node, duplicates)."""
        node, dup, now, new = self.root, [], next(self._clock), []
        for i, key in enumerate(self._keys(ids, len(pages) * self.page_size, namespace)):
            child = node.children.get(key)
            if child is None:
                assert i >= owned_from, "a matched page is missing from the tree (evicted while locked?)"
                child = Node(node, key, pages[i])
                node.children[key] = child
                self.cached_pages += 1
                self.evictable_pages += 1
                new.append(child)
            elif child.page < 0:  # a host-only node (tiers): it takes this device page
                assert i >= owned_from, "a matched page is not on the device"
                child.page = pages[i]
                self.cached_pages += 1
                self.evictable_pages += 1
                new.append(child)
            elif child.page != pages[i] and i >= owned_from:
                dup.append(pages[i])
            child.last_access = now
            node = child
        self._stored(new)
        return node, dup

    # ---- state snapshots (hybrid models) ---------------------------------------------------------
    def attach_states(self, node: Node, depth: int, states: list[tuple[int, int]]) -> list[int]:
        """Give the nodes on the path to `node` (`depth` pages deep) the snapshots `states` ((tokens,
        slot): the state after exactly that many tokens of this path, a multiple of the page size, at
        most depth pages) a request took. A node that holds one already keeps its own. Returns the
        slots not taken (the caller frees them)."""
        at: dict[int, int] = {}
        left: list[int] = []
        for tokens, slot in states:
            d = tokens // self.page_size
            if 0 < d <= depth and tokens % self.page_size == 0 and d not in at:
                at[d] = slot
            else:
                left.append(slot)
        while node is not self.root and at:
            slot = at.pop(depth, None)
            if slot is not None:
                if node.state < 0:
                    node.state = slot
                    self.snapshots += 1
                else:
                    left.append(slot)
            node = node.parent  # type: ignore[assignment]
            depth -= 1
        return left + list(at.values())

    def evict_states(self, n: int) -> int:
        """Drop up to n state snapshots, least recently used nodes first, the deeper of two used together
        first (as leaves go before their parents; their pages stay). Returns how many were dropped."""
        if n <= 0 or not self.snapshots:
            return 0
        held = [(x.last_access, -depth, id(x), x) for x, depth in self._depths() if x.state >= 0]
        victims = [x for *_, x in heapq.nsmallest(n, held)]
        self._drop_states(victims)
        return len(victims)

    def _depths(self) -> list[tuple[Node, int]]:
        """Every node with its depth in pages."""
        out, stack = [], [(c, 1) for c in self.root.children.values()]
        while stack:
            x, d = stack.pop()
            out.append((x, d))
            stack.extend((c, d + 1) for c in x.children.values())
        return out

    def _drop_states(self, nodes: list[Node]) -> None:
        slots = [x.state for x in nodes if x.state >= 0]
        for x in nodes:
            x.state = -1
        if slots:
            self.snapshots -= len(slots)
            self.evicted_states += len(slots)
            assert self.free_states is not None, "a state snapshot in a tree that cannot free it"
            self.free_states(slots)

    def _nodes(self) -> list[Node]:
        return [x for x, _ in self._depths()]

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, n: int) -> int:
        """Free at least n unlocked pages, least recently used leaves first (fewer when fewer are
        evictable; evict(0) is a no-op). Returns how many were freed."""
        if n <= 0:
            return 0
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        gone: list[Node] = []
        while heap and len(freed) < n:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key]
            freed.append(leaf.page)
            gone.append(leaf)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._removed(gone)
        self.cached_pages -= len(freed)
        self.evictable_pages -= len(freed)
        self.evicted_pages += len(freed)
        self.free_pages(freed)
        if self.snapshots:  # a node evicted drops its state snapshot
            self._drop_states(gone)
        return len(freed)

    def flush(self) -> int:
        """Evict everything unlocked (reported cleared when nothing is left) and every state snapshot
        (locked nodes' too: a snapshot is never in use); returns pages freed."""
        freed = self.evict(self.evictable_pages)
        if self.snapshots:
            self._drop_states(self._nodes())
        self._flushed()
        return freed

    def _flushed(self) -> None:
        if self.events is not None and not self.root.children:
            self.events.cleared()

    def _leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                out.append(node)
        return out
