"""HiRadixCache: the radix prefix cache over a device, a host and optionally a disk tier.

Residence (engine/kvcache/radix_cache.py, "Tiers"): a node holds a device page (`page` >= 0), a host page
(`host` >= 0), or both. Device residence is prefix-closed, so a match is a device stretch, then a
host stretch, then pages found on disk by their chained hash (they have no node).

- Device eviction (`evict`, called when an allocation runs short) takes device leaves (device
  pages with no device child, unlocked), least recently used first. A victim without a host copy
  is copied to a host page (write-back); one that gets none (host tier full of pinned work) is
  dropped with its host-only subtree. The node stays, host-only.
- Write-through (`write_through`): `insert` copies every new device page to the host at once, so
  eviction only drops the device page.
- Host eviction (`_host_room`) takes host-only leaves (dropped from the tree; with a disk tier
  their page is written to a file first) and host copies of nodes still on the device, least
  recently used first, never a node being loaded.
- `fetch` is `match` plus loads: host pages and then disk pages of the prompt's continuation are
  copied into fresh device pages (host nodes become both; disk pages become new device nodes),
  only when the whole prompt's pages fit the free pages (a request that cannot be admitted loads
  nothing, so a waiting request does not churn copies every step).
- `flush` empties every tier.
- Hybrid models (state snapshots on nodes, engine/kvcache/radix_cache.py): a snapshot lives in a device
  state slot whatever tier its node's page is on (a device eviction keeps it; a node dropped from the
  host drops it), and `fetch(..., need_state=True)` loads host pages only up to the deepest snapshot of
  the path (beyond it they could not be used: no state there). No disk tier for them (refused at start-up:
  a disk page has no node, so no snapshot).

Events (engine/kvcache/events): device pages are reported on medium "GPU", host copies on "CPU" (a
device eviction that keeps a host copy: removed from GPU, stored on CPU; a load: stored on GPU); the
disk tier is not reported.

Counters: `cached_pages`/`evictable_pages` count device pages (as without tiers); per tier stats
in `tier_stats` (hit tokens, loaded bytes, load seconds, evictions, bytes in use).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

from engine.kvcache.hicache.disk import DiskTier, chain
from engine.kvcache.hicache.host import HostTier
from engine.kvcache.memory import PageAllocator
from engine.kvcache.radix_cache import CPU, Match, Node, RadixCache

TIERS = ("device", "host", "disk")


class HiRadixCache(RadixCache):
    """A RadixCache whose evicted pages go to `host` (and on to `disk`, when given)."""

    def __init__(self, page_size: int, allocator: PageAllocator, host: HostTier, disk: DiskTier | None = None,
                 write_through: bool = False, free_states: Callable[[list[int]], None] | None = None) -> None:
        super().__init__(page_size, allocator.free, free_states)
        self.allocator, self.host, self.disk, self.write_through = allocator, host, disk, write_through
        self._pinned: set[int] = set()  # ids of host nodes being loaded: not host-evictable
        self.hits = dict.fromkeys(TIERS, 0)  # tokens served from each tier (host, disk: at load)
        self.loaded_bytes = {"host": 0, "disk": 0}
        self.load_seconds = {"host": 0.0, "disk": 0.0}
        self.evictions = dict.fromkeys(TIERS, 0)  # pages leaving each tier

    # ---- lookup with loads --------------------------------------------------------------------
    def fetch(self, ids: list[int], max_tokens: int, namespace: str, alloc: Callable[[int], list[int]],
              total_pages: int, need_state: bool = False) -> Match:
        """`match`, then load the continuation held on the host or disk into fresh device pages
        (`alloc(n)`, which may evict) when `total_pages` (the prompt's pages) fit the free pages
        with the device hit counted. The result's pages are all on the device (none locked).
        `need_state` (hybrid models): the match ends at the deepest state snapshot of the path, and only
        host pages up to it are loaded."""
        full = self.match(ids, max_tokens, namespace)  # the device stretch
        keys = self._keys(ids, max_tokens, namespace)
        i, node = len(full.pages), full.node
        # what a fetch that loads nothing gives (hybrid: the device stretch cut back to its deepest snapshot)
        hit = self.match(ids, max_tokens, namespace, need_state=True) if need_state else full
        if i == len(keys):
            return hit
        hosted, n = [], node
        while i + len(hosted) < len(keys):
            n = n.children.get(keys[i + len(hosted)])  # type: ignore[assignment]
            if n is None:
                break
            hosted.append(n)
        if need_state:  # up to the deepest snapshot among the host pages (none: the device match)
            hosted = hosted[: max((k + 1 for k, h in enumerate(hosted) if h.state >= 0), default=0)]
            disk_keys: list[bytes] = []
        else:
            disk_keys = self._disk_run(node, hosted, keys[i + len(hosted):])
        want = len(hosted) + len(disk_keys)
        if not want:
            return hit
        self.lock(node)  # the device stretch survives the allocation's evictions
        try:
            if self.allocator.num_free + self.evictable_pages < total_pages - i:
                return hit
            self._pinned = {id(h) for h in hosted}
            pages = alloc(want)
            self._pinned = set()
            last = self._load_host(hosted, pages[: len(hosted)]) or node
            last, used = self._load_disk(last, keys[i + len(hosted):], disk_keys, pages[len(hosted):])
            if used < len(disk_keys):
                self.free_pages(pages[len(hosted) + used:])
        finally:
            self._pinned = set()
            self.unlock(node)
        return Match(full.pages + pages[: len(hosted) + used], last)

    def _disk_run(self, node: Node, hosted: list[Node], keys: list[tuple]) -> list[bytes]:
        """Chained hashes of the pages after the tree's deepest match that the disk tier holds."""
        if self.disk is None or not keys:
            return []
        h, out = self._hash(hosted[-1] if hosted else node), []
        for key in keys:
            h = chain(h, key)
            if not self.disk.contains(h):
                break
            out.append(h)
        return out

    def _hash(self, node: Node) -> bytes:
        """The chained page hash of the path to `node` (the disk seed for the root), memoized."""
        assert self.disk is not None
        path = []
        while node is not self.root and node.hash is None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        h = self.disk.seed if node is self.root else node.hash
        for n in reversed(path):
            h = n.hash = chain(h, n.key)  # type: ignore[arg-type]
        return h  # type: ignore[return-value]

    def _load_host(self, hosted: list[Node], pages: list[int]) -> Node | None:
        if not hosted:
            return None
        t0 = time.perf_counter()
        self.host.load([h.host for h in hosted], pages)
        self.load_seconds["host"] += time.perf_counter() - t0
        now = next(self._clock)
        for h, p in zip(hosted, pages):
            h.page, h.last_access = p, now
        self._stored(hosted)
        self.cached_pages += len(pages)
        self.evictable_pages += len(pages)
        self.hits["host"] += len(pages) * self.page_size
        self.loaded_bytes["host"] += len(pages) * self.host.page_bytes
        return hosted[-1]

    def _load_disk(self, node: Node, keys: list[tuple], hashes: list[bytes], pages: list[int]) -> tuple[Node, int]:
        """Read disk pages into `pages` as new device nodes under `node`, stopping at the first miss."""
        assert len(hashes) <= len(keys)
        t0, used, now, new = time.perf_counter(), 0, next(self._clock), []
        for key, h, p in zip(keys, hashes, pages):
            data = self.disk.get(h, self.host.page_bytes)  # type: ignore[union-attr]
            if data is None:
                break
            self.host.write_device(p, data)
            child = Node(node, key, p)
            child.hash, child.last_access = h, now
            node.children[key] = child
            node, used = child, used + 1
            new.append(child)
        self._stored(new)
        if hashes:
            self.load_seconds["disk"] += time.perf_counter() - t0
        self.cached_pages += used
        self.evictable_pages += used
        self.hits["disk"] += used * self.page_size
        self.loaded_bytes["disk"] += used * self.host.page_bytes
        return node, used

    # ---- insert (write-through) -----------------------------------------------------------------
    def insert(self, ids: list[int], pages: list[int], owned_from: int,
               namespace: str = "") -> tuple[Node, list[int]]:
        node, dup = super().insert(ids, pages, owned_from, namespace)
        if self.write_through:
            path, n = [], node
            while n is not self.root and n.host < 0:
                path.append(n)
                n = n.parent  # type: ignore[assignment]
            self._store(path[::-1], exclude=set())
        return node, dup

    def _store(self, nodes: list[Node], exclude: set[int]) -> list[Node]:
        """Give `nodes` (device, no host copy; the first ones preferred) host copies, making room;
        returns those that got none."""
        if not nodes:
            return []
        got = self._host_room(len(nodes), exclude | {id(n) for n in nodes})
        kept, left = nodes[:got], nodes[got:]
        host = self.host.allocator.allocate(len(kept))
        self.host.store([n.page for n in kept], host)
        for n, h in zip(kept, host):
            n.host = h
        self._stored(kept, CPU)
        return left

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, n: int) -> int:
        """Free at least n unlocked device pages (fewer when fewer are evictable), device leaves
        least recently used first; each keeps a host copy where the host tier has room."""
        if n <= 0:
            return 0
        victims = self._device_victims(n)
        if not victims:
            return 0
        taken = {id(v) for v in victims}
        # ancestors come after their descendants in `victims`: give host pages to ancestors first
        dropped = self._store([v for v in reversed(victims) if v.host < 0], exclude=taken)
        freed = [v.page for v in victims]
        for v in victims:
            v.page = -1
        self._removed(victims)
        self.cached_pages -= len(victims)
        self.evictable_pages -= len(victims)
        self.evicted_pages += len(victims)
        self.evictions["device"] += len(victims)
        self.free_pages(freed)
        for v in dropped:
            if v.parent is not None:  # not inside a subtree dropped before it
                self._drop_subtree(v)
        return len(victims)

    def _device_victims(self, n: int) -> list[Node]:
        heap = [(x.last_access, id(x), x) for x in self._device_leaves()]
        heapq.heapify(heap)
        out: list[Node] = []
        gone: set[int] = set()
        while heap and len(out) < n:
            _, _, v = heapq.heappop(heap)
            out.append(v)
            gone.add(id(v))
            p = v.parent
            if p is not None and p is not self.root and p.lock_ref == 0 and \
                    not any(c.page >= 0 and id(c) not in gone for c in p.children.values()):
                heapq.heappush(heap, (p.last_access, id(p), p))
        return out

    def _device_leaves(self) -> list[Node]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            on_dev = [c for c in node.children.values() if c.page >= 0]
            stack.extend(on_dev)
            if not on_dev and node is not self.root and node.lock_ref == 0:
                out.append(node)
        return out

    def _host_room(self, k: int, exclude: set[int]) -> int:
        """Make up to k host pages free (evicting host copies LRU, never `exclude`d or pinned
        nodes); returns how many are free now, at most k."""
        alloc = self.host.allocator
        if alloc.num_free >= k:
            return k
        skip = exclude | self._pinned
        heap = [(x.last_access, id(x), x) for x in self._iter() if x.host >= 0 and id(x) not in skip
                and (x.page >= 0 or not x.children)]
        heapq.heapify(heap)
        while heap and alloc.num_free < k:
            _, _, x = heapq.heappop(heap)
            self.evictions["host"] += 1
            if x.page >= 0:  # still on the device: only its host copy goes
                alloc.free([x.host])
                x.host = -1
                self._removed([x], CPU)
                continue
            self._spill_to_disk(x)
            p = x.parent
            self._drop_subtree(x)  # a leaf: only x goes
            if p is not None and p is not self.root and p.page < 0 and p.host >= 0 and not p.children \
                    and id(p) not in skip:
                heapq.heappush(heap, (p.last_access, id(p), p))
        return min(k, alloc.num_free)

    def _spill_to_disk(self, x: Node) -> None:
        if self.disk is None:
            return
        h = self._hash(x)
        if self.disk.put(h, self.host.page_bytes_of(x.host)):
            self.evictions["disk"] = self.disk.evictions

    def _drop_subtree(self, node: Node) -> None:
        """Remove `node` and its descendants (none locked) from the tree, freeing their pages; each
        removed node's parent becomes None (it is gone)."""
        assert node.parent is not None
        del node.parent.children[node.key]
        dev, host, stack, on_dev, on_host, gone = [], [], [node], [], [], []
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            x.parent = None
            assert x.lock_ref == 0, "dropping a locked node"
            if x.page >= 0:
                dev.append(x.page)
                on_dev.append(x)
            if x.host >= 0:
                host.append(x.host)
                on_host.append(x)
            if x.state >= 0:  # a hybrid model's snapshot goes with its node
                gone.append(x)
        if gone:
            self._drop_states(gone)
        self._removed(on_dev)
        self._removed(on_host, CPU)
        self.cached_pages -= len(dev)
        self.evictable_pages -= len(dev)
        self.evicted_pages += len(dev)
        if dev:
            self.free_pages(dev)
        if host:
            self.host.allocator.free(host)

    def _iter(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out

    def flush(self) -> int:
        """Empty every tier of what no request holds: unlocked subtrees are dropped whole, host copies
        of locked nodes freed, the disk emptied. Returns device pages freed."""
        before = self.cached_pages
        if self.snapshots:  # every snapshot, locked nodes' too (a snapshot is never in use)
            self._drop_states(self._nodes())
        stack = [self.root]
        while stack:
            x = stack.pop()
            for c in list(x.children.values()):
                if c.lock_ref == 0:
                    self._drop_subtree(c)
                else:
                    if c.host >= 0:
                        self.host.allocator.free([c.host])
                        c.host = -1
                        self._removed([c], CPU)
                    stack.append(c)
        if self.disk is not None:
            self.disk.clear()
        self._flushed()
        return before - self.cached_pages

    # ---- stats --------------------------------------------------------------------------------
    def tier_stats(self, hit_tokens: int) -> dict[str, dict[str, float]]:
        """Per statistic, per tier: hit_tokens, loaded_bytes, load_seconds, evictions (totals) and
        bytes_in_use (level). `hit_tokens` is every cached token handed to a request (the caller's
        count, net of unmatched requests); the device's share is what no load brought in."""
        pb = self.host.page_bytes
        self.hits["device"] = max(0, hit_tokens - self.hits["host"] - self.hits["disk"])
        in_use = {"device": self.cached_pages * pb, "host": self.host.used_pages * pb}
        if self.disk is not None:
            in_use["disk"] = self.disk.bytes_used
            self.evictions["disk"] = self.disk.evictions
        tiers = set(in_use)
        return {"hit_tokens": {k: v for k, v in self.hits.items() if k in tiers},
                "loaded_bytes": {k: v for k, v in self.loaded_bytes.items() if k in tiers},
                "load_seconds": {k: round(v, 6) for k, v in self.load_seconds.items() if k in tiers},
                "evictions": {k: v for k, v in self.evictions.items() if k in tiers},
                "bytes_in_use": in_use}
