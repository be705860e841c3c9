"""Page bookkeeping for requests: grow, free, offload to host (retraction) and reload, and the
admission rule.

All page movement of a request goes through here, so "every page and host copy is freed" has one
place to hold. The admission rule (`KVManager.can_admit`, over `reservation` and `free_pages`) is
written here once; every admission asks it: the extend planner (colocated, PD prefill, a PD decode's
local prefill), preemption (engine.scheduling.priority, through the colocated scheduler or the PD
decode) and the PD decode's pre-allocation of a prompt's pages.

Sliding-window models (`window` > 0: every layer attends to at most that many tokens back) never
read a page again once it lies wholly before the next query's window: `trim` frees such pages while
the request runs and leaves 0 (the reserved page) in their place in `req.kv.pages`, which stays indexed
by position; `req.kv.dropped_pages` counts them. A long generation then holds O(window) pages, and
retraction offloads only the live ones.

Prefix cache (`prefix_cache=True`; not on sliding-window models: a sliding window frees pages a later
request would share, so a windowed model runs without it; hybrid models: with state snapshots, below):
`match` gives a new request the pages of its longest cached page-aligned prefix
(`engine/kvcache/radix_cache.py`), locked, as the first `req.kv.shared_pages` entries of
`req.kv.pages`, and sets `kv_len`/`cached_tokens` so only the rest is computed.
`release` inserts the request's full pages into the tree (the tree takes them; duplicates and the
partial last page are freed) and unlocks. The tree's unlocked pages count as free
(`free_pages`): allocation evicts them, LRU, when the free list runs short, so the admission rule
needs no second form. Retraction copies the shared pages to the host too and drops the lock (a
retracted request holds no device page); the cache keeps them, evictable.

Forks (parallel sampling, engine.scheduling.parallel): `fork` gives a choice the parent's prompt KV. The full
prompt pages are shared through `tree` (the prefix cache, or with the cache off a private tree that
keeps nothing unlocked: pages go back to the free list when the last choice lets go), locked by
every choice like a matched prefix; the partial last page is copied. A sliding-window model has no
tree: a fork copies the live pages.

Recurrent state (hybrid models, `states`: engine/recurrent/state_pool.py): every running request
also holds one state slot, valid at `kv_len` tokens. `grow` takes the slots of a request and of its
forks at its admission (the forks' slots wait for the fork, so a computed prompt never waits for a
slot), the admission rule counts free slots beside pages, `fork` copies the parent's slot, retraction
saves the slot to the host with the KV and frees it, reload takes a fresh one, `release` frees it.

Speculative verifies on a hybrid model take position-state slots from a third share (`verify_slots`,
K per speculating request: engine/extras/speculative/states.py), held from before a verify to its settle.

State snapshots (hybrid models with the prefix cache; `snapshot_slots` > 0, else the cache is off for
them and the private tree still shares forks' prompt pages): a cached prefix is reusable only with
the recurrent state at its end. `checkpoint`, after every forward, copies a request's slot into a
snapshot slot when its computed length is a multiple of `snapshot_interval` or its prompt's last page
boundary (`snapshot_points`; `snapshot_cut` makes prompt chunks end there); the request keeps them
(`req.kv.snapshots`) until `release` hands them to the tree with its pages (`RadixCache.attach_states`;
freed when it inserts nothing). `match` takes the longest match cut back to its deepest snapshot and
copies that snapshot into the request's own slot. Snapshot slots have their own budget
(`snapshot_slots`, --state-cache-slots, beside the requests' --max-state-slots): the admission rule
counts only the requests' share (`free_slots`), a new snapshot beyond the budget replaces the least
recently used cached one (none cached: it is not taken), and a node evicted frees its snapshot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from engine.kvcache.hicache import HiCacheSpec, HiRadixCache, build_cache
from engine.kvcache.hicache.host import HostTier
from engine.kvcache.memory import HostKVPool, KVPool, pages_for
from engine.kvcache.radix_cache import RadixCache
from engine.recurrent.state_pool import StatePool
from engine.request import Req
from engine.stats import PrefixCacheStats


def reservation(reqs: Iterable[Req], ratio: float, page_size: int) -> int:
    """Pages kept back for the future tokens of `reqs`: for each, new_token_ratio of the tokens it
    may still generate, rounded up to whole pages (ratio 0 reserves nothing: admit greedily and rely
    on retraction)."""
    return sum(pages_for(int(ratio * (r.sampling.max_new_tokens - r.num_output_tokens)), page_size) for r in reqs)


class KVManager:
    def __init__(self, pool: KVPool, host_pool: HostKVPool, window: int = 0, prefix_cache: bool = False,
                 hicache: HiCacheSpec | None = None, states: StatePool | None = None, snapshot_slots: int = 0,
                 snapshot_interval: int = 0, host_tier: Callable[[KVPool, int], HostTier] = HostTier,
                 verify_slots: int = 0) -> None:
        self.pool = pool
        self.states = states  # hybrid models' recurrent-state slots (None: attention only)
        self.host = host_pool
        self.page_size = pool.page_size
        self.window = window  # tokens the widest layer looks back; 0 = some layer sees everything
        self.retractions = 0
        self.reloads = 0
        self.trimmed_pages = 0  # pages freed because they fell out of every layer's window
        self.hit_tokens = 0  # prompt tokens taken from the prefix cache instead of computed
        # hybrid models: the pool's slots kept for the cache's state snapshots (the rest are the requests')
        snaps = snapshot_slots if states is not None else 0
        use_cache = prefix_cache and not window and (states is None or (snaps > 0 and snapshot_interval > 0))
        self.snapshot_slots = snaps if use_cache else 0
        # speculative verifies' position states (engine/extras/speculative/states.py): their own share
        self.verify_slots = verify_slots if states is not None else 0
        self.verify_held = 0
        self.request_slots = 0 if states is None else states.capacity - snaps - self.verify_slots  # --max-state-slots
        self.snapshot_interval = snapshot_interval
        self.snapshots_held = 0  # snapshot slots held by requests (not yet in the tree)
        self.snapshots_taken = 0  # total
        self.cache = RadixCache(self.page_size, pool.allocator.free, self._free_states) if use_cache else None
        if use_cache and hicache is not None:  # host (and disk) tiers under the cache (engine/kvcache/hicache)
            if states is not None and hicache.disk_dir:
                raise ValueError("the disk tier of the prefix cache cannot hold recurrent-state snapshots")
            self.cache = build_cache(hicache, pool, host_tier, self._free_states if states is not None else None)
        # the tree forked choices share prompt pages through (the cache, else private; None: copy)
        self.tree = self.cache if self.cache is not None else \
            (None if window else RadixCache(self.page_size, pool.allocator.free))

    @classmethod
    def for_runner(cls, runner: Any, prefix_cache: bool, hicache: HiCacheSpec | None = None) -> KVManager:
        """The manager of a runner's pools (device, host and, for a hybrid model, its state slots: the
        requests' --max-state-slots, the rest the prefix cache's snapshots). A TP group's rank 0 runner names
        its `host_tier` (the host tier's copies run on every rank)."""
        states = getattr(runner, "states", None)
        tier = getattr(runner, "host_tier", HostTier)
        if states is None:
            return cls(runner.pool, runner.host_pool, runner.model_cfg.max_window, prefix_cache, hicache,
                       host_tier=tier)
        verify = runner.cfg.state_verify_slots
        return cls(runner.pool, runner.host_pool, runner.model_cfg.max_window, prefix_cache, hicache, states,
                   states.capacity - runner.cfg.state_request_slots - verify, runner.cfg.state_snapshot_interval, tier,
                   verify)

    # ---- prefix cache -------------------------------------------------------------------------
    def match(self, req: Req) -> int:
        """Give a request that holds no pages its longest cached prefix (locked); returns its tokens.
        At least the last prompt token is always computed (its logits are sampled), and prompt
        logprobs asked for are never skipped."""
        if self.cache is None or req.kv.pages or req.kv.host_pages:
            return 0
        limit = len(req.token_ids) - 1
        if req.logprobs.wants_input:
            limit = min(limit, max(req.logprobs.start_len, 1) - 1)
        if req.features.hidden:  # every prompt position's hidden state is computed (engine.extras.features)
            limit = 0
        if self.states is not None:  # up to the deepest state snapshot, copied into req's own slot
            if limit < self.page_size or not self.slots_free_for(req):
                return 0  # (no slot: it is not admitted now anyway)
            if isinstance(self.cache, HiRadixCache):  # host pages up to the deepest snapshot loaded
                hit = self.cache.fetch(req.token_ids, limit, req.cache_namespace, self._allocate,
                                       pages_for(len(req.token_ids), self.page_size), need_state=True)
            else:
                hit = self.cache.match(req.token_ids, limit, req.cache_namespace, need_state=True)
            if not hit.pages:
                return 0
            self.take_slots(req, forks=False)
            self.states.copy(hit.node.state, req.kv.state_slot)
        elif isinstance(self.cache, HiRadixCache):  # loads host/disk pages of the prefix into device pages
            hit = self.cache.fetch(req.token_ids, limit, req.cache_namespace, self._allocate,
                                   pages_for(len(req.token_ids), self.page_size))
        else:
            hit = self.cache.match(req.token_ids, limit, req.cache_namespace)
        if not hit.pages:
            return 0
        self.cache.lock(hit.node)
        req.kv.prefix_node, req.kv.shared_pages, req.kv.pages = hit.node, len(hit.pages), list(hit.pages)
        req.kv.kv_len = req.kv.cached_tokens = len(hit.pages) * self.page_size
        self.hit_tokens += req.kv.kv_len
        return req.kv.kv_len

    def unmatch(self, req: Req) -> None:
        """Undo `match` for a request that was not admitted after all (it computed nothing)."""
        if self.cache is None or req.kv.prefix_node is None:
            return
        assert len(req.kv.pages) == req.kv.shared_pages and req.kv.kv_len == req.kv.cached_tokens
        self._unlock(req)
        self.hit_tokens -= req.kv.kv_len
        req.kv.pages, req.kv.kv_len, req.kv.cached_tokens = [], 0, 0
        self._free_slot(req)  # a hybrid model's slot, which took the snapshot

    def unreserve(self, req: Req) -> None:
        """Give back what a request reserved but never filled (its own pages) and undo its match: a
        PD decode whose prefill refused its cached prefix starts the transfer over, whole."""
        own = req.kv.pages[self._head(req) :]
        del req.kv.pages[self._head(req) :]
        if own:
            self.pool.allocator.free(own)
        self.unmatch(req)

    def prefix_len(self, req: Req) -> int:
        """Tokens of req a match would take from the cache now (read-only; the lpm policy's key)."""
        if self.cache is None:
            return 0
        return self.cache.match_len(req.token_ids, len(req.token_ids) - 1, req.cache_namespace,
                                    need_state=self.states is not None)

    def flush(self) -> int:
        """Drop every unlocked cached page and every cached state snapshot (the caller checks the
        service is idle); returns pages."""
        return 0 if self.cache is None else self.cache.flush()

    def cache_stats(self) -> PrefixCacheStats:
        c = self.cache
        return PrefixCacheStats(cached_tokens=0 if c is None else c.cached_pages * self.page_size,
                                hit_tokens=self.hit_tokens,
                                evicted_tokens=0 if c is None else c.evicted_pages * self.page_size,
                                tiers=c.tier_stats(self.hit_tokens) if isinstance(c, HiRadixCache) else {},
                                state_snapshots=self.snapshots_held + self.cached_snapshots,
                                state_snapshot_slots=self.snapshot_slots,
                                state_snapshots_taken=self.snapshots_taken,
                                state_snapshots_evicted=0 if c is None else c.evicted_states)

    # ---- state snapshots (hybrid models) ----------------------------------------------------------
    @property
    def cached_snapshots(self) -> int:
        """State snapshots the tree holds (each one slot; all of them droppable)."""
        return 0 if self.cache is None else self.cache.snapshots

    def snapshot_points(self, req: Req) -> tuple[int, int]:
        """(interval, prompt point) of req's snapshots: lengths that are multiples of the interval, and
        its prompt's last page boundary before its last token (the same prompt again, whose last token is
        always computed, restarts there). (0, 0): it takes none (no state snapshots here)."""
        if not self.snapshot_slots:
            return 0, 0
        return self.snapshot_interval, (req.num_prompt_tokens - 1) // self.page_size * self.page_size

    def _snapshot_room(self) -> bool:
        """Whether a new snapshot can get a slot (a free one of the budget, or a cached one's)."""
        return self.snapshots_held + self.cached_snapshots < self.snapshot_slots or self.cached_snapshots > 0

    def snapshot_cut(self, req: Req, n: int) -> int:
        """Tokens of req's next prompt chunk of up to `n` to compute now: the chunk ends at the
        deepest snapshot point inside it (so the state there can be copied after the forward), else n.
        At most one snapshot a chunk: a chunk longer than the interval is not split further."""
        every, prompt_point = self.snapshot_points(req)
        if not every or not self._snapshot_room():
            return n
        start, end = req.kv.kv_len, req.kv.kv_len + n
        cut = (end - 1) // every * every
        if start < prompt_point < end:
            cut = max(cut, prompt_point)
        return cut - start if cut > start else n

    def checkpoint(self, req: Req) -> bool:
        """After a forward: snapshot req's state if its computed length (kv_len) is a snapshot point it
        has not snapshotted and the cache does not give it (a copy of its slot into a snapshot slot,
        kept in req.kv.snapshots until `release`). Returns whether it took one."""
        every, prompt_point = self.snapshot_points(req)
        n = req.kv.kv_len
        if not every or n <= req.kv.cached_tokens or req.kv.state_slot < 0 or (n % every and n != prompt_point):
            return False
        if req.kv.snapshots and req.kv.snapshots[-1][0] >= n:
            return False
        slot = self._snapshot_slot()
        if slot < 0:
            return False
        self.states.copy(req.kv.state_slot, slot)  # type: ignore[union-attr]
        req.kv.snapshots.append((n, slot))
        self.snapshots_held += 1
        self.snapshots_taken += 1
        return True

    def _snapshot_slot(self) -> int:
        """A state slot for a new snapshot within the budget (the least recently used cached snapshot
        dropped when the budget is full); -1 when every snapshot slot is held by a request."""
        assert self.cache is not None and self.states is not None
        if self.snapshots_held + self.cache.snapshots >= self.snapshot_slots and not self.cache.evict_states(1):
            return -1
        if not self.states.num_free:  # only a scratch slot taken past the admission rule can do this
            return -1
        return self.states.allocate(1)[0]

    def _free_states(self, slots: list[int]) -> None:
        self.states.free(slots)  # type: ignore[union-attr]

    def _drop_snapshots(self, req: Req, node: Any = None, depth: int = 0) -> None:
        """req's snapshots go to the tree's nodes on the path to `node` (`depth` pages), or are freed."""
        snaps, req.kv.snapshots = req.kv.snapshots, []
        if not snaps:
            return
        self.snapshots_held -= len(snaps)
        if node is None:
            left = [slot for _, slot in snaps]
        else:
            left = self.cache.attach_states(node, depth, snaps)  # type: ignore[union-attr]
        if left:
            self.states.free(left)  # type: ignore[union-attr]

    def _allocate(self, n: int) -> list[int]:
        alloc = self.pool.allocator
        if self.cache is not None and n > alloc.num_free:
            self.cache.evict(n - alloc.num_free)
        return alloc.allocate(n)

    def extra_pages(self, req: Req, new_tokens: int, prefix: int = 0) -> int:
        """Pages req still needs so that kv_len + new_tokens tokens fit. `prefix`: tokens of a cached
        prefix a request not yet matched would take (`prefix_len`), counted as held."""
        ps = self.page_size
        return max(0, pages_for(req.kv.kv_len + prefix + new_tokens, ps) - len(req.kv.pages) - prefix // ps)

    def grow(self, req: Req, new_tokens: int) -> None:
        self.take_slots(req)
        n = self.extra_pages(req, new_tokens)
        if n:
            req.kv.pages.extend(self._allocate(n))

    def rollback(self, req: Req) -> int:
        """Free the request's own pages wholly past its computed tokens (kv_len): a speculative verify
        wrote KV at positions it then rejected (engine/extras/speculative). Returns pages freed."""
        keep = max(pages_for(req.kv.kv_len, self.page_size), self._head(req))
        extra = req.kv.pages[keep:]
        if extra:
            del req.kv.pages[keep:]
            self.pool.allocator.free(extra)
        return len(extra)

    def window_start(self, kv_len: int) -> int:
        """Index of the first page a query at position kv_len (or later) can read: pages before it
        lie wholly outside every layer's window. 0 without a sliding window."""
        if not self.window:
            return 0
        return min(max(0, kv_len - self.window + 1) // self.page_size, max(0, pages_for(kv_len, self.page_size) - 1))

    def peak_pages(self, prompt_tokens: int, chunk: int) -> int:
        """Most pages a request holds at once while its prompt is computed in chunks of at most
        `chunk` tokens and its next token decoded. With a sliding window the pages behind the window
        are trimmed after each step, so the peak is the window plus one chunk (plus the page each end
        straddles), not the whole prompt."""
        whole = pages_for(prompt_tokens + 1, self.page_size)
        if not self.window:
            return whole
        return min(whole, pages_for(self.window + max(1, chunk), self.page_size) + 1)

    def capacity_error(self, prompt_tokens: int, chunk: int = 0, forks: int = 0) -> str | None:
        """Why a prompt can never fit this pool (its live KV plus one token, and with n > 1 the pages
        its `forks` other choices take once it is computed), or None. `chunk` is the largest prompt
        chunk one step computes (0: the whole prompt at once)."""
        cap = self.pool.allocator.capacity
        if self.states is not None and forks + 1 > self.request_slots:
            return (f"the request's {forks + 1} choices need {forks + 1} recurrent-state slots at once; the "
                    f"state pool holds {self.request_slots} for requests (--max-state-slots)")
        if self.peak_pages(prompt_tokens, chunk or prompt_tokens) > cap:
            return f"the prompt has {prompt_tokens} tokens; the KV pool holds {cap * self.page_size}"
        need = pages_for(prompt_tokens, self.page_size) - self.window_start(prompt_tokens) + \
            forks * self.fork_pages(prompt_tokens)
        if forks and need > cap:
            return (f"the prompt has {prompt_tokens} tokens and its {forks + 1} choices need "
                    f"{need * self.page_size} tokens of KV at once; the KV pool holds {cap * self.page_size}")
        return None

    def outgrows_pool(self, req: Req, new_tokens: int = 1) -> bool:
        """Whether req's live KV with `new_tokens` more tokens exceeds the whole pool: no retraction
        of others can make room for it (the scheduler ends it at the pool's end, finish reason length,
        instead of retracting it forever: `pool_end_message`)."""
        live = pages_for(req.kv.kv_len + new_tokens, self.page_size) - req.kv.dropped_pages
        return live > self.pool.allocator.capacity

    def pool_end_message(self, req: Req) -> str:
        return (f"the KV pool is full: this request holds {req.kv.kv_len} tokens and the pool holds "
                f"{self.pool.allocator.capacity * self.page_size}")

    def can_admit(self, req: Req, need: int, reserved: int, ratio: float, busy: bool) -> bool:
        """The admission rule. `req` takes `need` pages now (what its admission allocates: a prompt
        chunk, a whole prompt's KV, its forks' pages); they must be free, and while other requests hold
        pages (`busy`), `need` plus req's own reservation (`reservation` at `ratio` of req and the
        choices waiting on it; ratio 0: none, as for the prefill or a prompt's later chunk) must fit
        in the free pages less `reserved` (what is kept for requests admitted before: their
        reservations, and pages promised to them). With nothing else holding pages, `need` alone
        decides, so a request the pool can hold is never refused forever."""
        own = reservation([req, *req.choice.forks], ratio, self.page_size) if ratio else 0
        free = self.free_pages
        return need <= free and (not busy or need + own <= free - reserved) and self.slots_free_for(req)

    def slots_needed(self, req: Req) -> int:
        """State slots req and its forks still need (0 for attention-only models)."""
        if self.states is None:
            return 0
        return sum(1 for c in (req, *req.choice.forks) if c.kv.state_slot < 0)

    @property
    def slots_used(self) -> int:
        """State slots requests (and scratch computations) hold; snapshots not counted."""
        if self.states is None:
            return 0
        return self.states.num_used - self.snapshots_held - self.cached_snapshots - self.verify_held

    @property
    def free_slots(self) -> int:
        """State slots a request can take now: the requests' share of the pool (--max-state-slots) less
        what they hold. Snapshots have their own share, so they never stand in a request's way (and a
        request never evicts one)."""
        if self.states is None:
            return 0
        return self.request_slots - self.slots_used

    def slots_free_for(self, req: Req) -> bool:
        return self.states is None or self.slots_needed(req) <= self.free_slots

    def slots_free_for_scratch(self) -> bool:
        """Whether a computation outside any request (an embedding) can take a state slot now."""
        return self.states is None or self.free_slots > 0

    def take_slots(self, req: Req, forks: bool = True) -> None:
        """Give req and (`forks`) its forks a state slot each (hybrid models; the caller checked
        slots_free_for)."""
        if self.states is None:
            return
        for c in (req, *req.choice.forks) if forks else (req,):
            if c.kv.state_slot < 0:
                c.kv.state_slot = self.states.allocate(1)[0]

    def take_verify_slots(self, n: int) -> list[int]:
        """n state slots of the speculative verifies' share for one verify's position states ([]: the
        share cannot give them now, the request decodes plainly this step)."""
        if self.states is None or self.verify_held + n > self.verify_slots or n > self.states.num_free:
            return []
        self.verify_held += n
        return self.states.allocate(n)

    def free_verify_slots(self, slots: list[int]) -> None:
        if slots:
            self.states.free(slots)  # type: ignore[union-attr]
            self.verify_held -= len(slots)

    def _free_slot(self, req: Req) -> None:
        if self.states is not None and req.kv.state_slot >= 0:
            self.states.free([req.kv.state_slot])
        if self.states is not None and req.kv.host_state is not None:
            self.states.discard(req.kv.host_state)
        req.kv.state_slot, req.kv.host_state = -1, None

    @property
    def free_pages(self) -> int:
        """Pages an allocation can get: the free list plus the cache's evictable pages."""
        return self.pool.allocator.num_free + (0 if self.cache is None else self.cache.evictable_pages)

    @property
    def used_tokens(self) -> int:
        """KV tokens held by requests (pages no eviction can reclaim): 0 when idle, cache or not."""
        return (self.pool.allocator.capacity - self.free_pages) * self.page_size

    def allocate(self, n: int) -> list[int]:
        """n device pages for a request's own use (evicting cached pages if needed)."""
        return self._allocate(n)

    def trim(self, req: Req) -> int:
        """Free the pages no future query of `req` can see (sliding window); returns how many."""
        if not self.window or req.kv.host_pages:
            return 0
        keep_from = min(self.window_start(req.kv.kv_len), len(req.kv.pages))  # the next query sits at kv_len
        if keep_from <= req.kv.dropped_pages:
            return 0
        gone = req.kv.pages[req.kv.dropped_pages : keep_from]
        self.pool.allocator.free(gone)
        req.kv.pages[req.kv.dropped_pages : keep_from] = [0] * len(gone)
        req.kv.dropped_pages = keep_from
        self.trimmed_pages += len(gone)
        return len(gone)

    def release(self, req: Req) -> None:
        """Free every device page and host copy the request holds (idempotent). With the prefix
        cache, the full pages of its computed tokens (prompt and output) go to the tree instead,
        and its lock on the shared prefix is dropped."""
        own = req.kv.pages[self._head(req) :]
        if self.cache is not None and req.kv.pages and not req.kv.host_pages:
            full = min(req.kv.kv_len // self.page_size, len(req.kv.pages))
            node, dup = self.cache.insert(req.token_ids, req.kv.pages[:full], req.kv.shared_pages,
                                          req.cache_namespace)
            own = dup + req.kv.pages[max(full, req.kv.shared_pages) :]
            self._drop_snapshots(req, node, full)  # hybrid models: its snapshots go to the nodes at their lengths
        self._drop_snapshots(req)  # none inserted: freed
        if own:
            self.pool.allocator.free(own)
        req.kv.pages = []
        self._unlock(req)
        self._free_slot(req)
        if req.kv.host_pages:
            self.host.free(req.kv.host_pages)
            req.kv.host_pages = []

    def _unlock(self, req: Req) -> None:
        """Drop req's lock on its shared prefix (a private fork tree frees what nobody holds now)."""
        if req.kv.prefix_node is None:
            return
        self.tree.unlock(req.kv.prefix_node)  # type: ignore[union-attr]
        req.kv.prefix_node, req.kv.shared_pages = None, 0
        if self.cache is None:
            self.tree.flush()  # type: ignore[union-attr]

    # ---- forks (parallel sampling) -------------------------------------------------------------
    def fork_pages(self, prompt_tokens: int) -> int:
        """Pages one fork of a computed prompt of `prompt_tokens` tokens allocates: its partial last
        page (shared full pages), or every live page (no tree: a sliding-window model copies)."""
        whole = pages_for(prompt_tokens, self.page_size)
        if self.tree is not None:
            return whole - prompt_tokens // self.page_size
        return whole - self.window_start(prompt_tokens)

    def fork(self, parent: Req, child: Req) -> None:
        """Give `child` (holding nothing) the KV of `parent`, whose prompt is computed and which has
        generated nothing past its first token: shared full prompt pages (locked by child too) plus a
        copy of the rest. The caller checked `fork_pages` fit (free_pages)."""
        assert not child.kv.pages and not child.kv.host_pages and parent.kv.kv_len == parent.num_prompt_tokens
        if self.tree is not None:
            self._share_prompt(parent)
        head = self._head(parent)
        rest = parent.kv.pages[head:]
        new = self._allocate(len(rest))
        self.pool.copy_pages(rest, new)
        child.kv.pages = parent.kv.pages[:head] + new
        child.kv.dropped_pages = parent.kv.dropped_pages
        if parent.kv.prefix_node is not None:
            self.tree.lock(parent.kv.prefix_node)  # type: ignore[union-attr]
            child.kv.prefix_node, child.kv.shared_pages = parent.kv.prefix_node, parent.kv.shared_pages
        child.kv.kv_len, child.kv.cached_tokens = parent.kv.kv_len, parent.kv.cached_tokens
        if self.states is not None:  # the prompt's final state (the child's slot was taken with the parent's)
            self.take_slots(child)
            self.states.copy(parent.kv.state_slot, child.kv.state_slot)

    def _share_prompt(self, req: Req) -> None:
        """Move req's full prompt pages into the tree, locked by req (as if it had matched them).
        A page the tree already holds for the same tokens replaces req's copy, which is freed."""
        tree, ps = self.tree, self.page_size
        assert tree is not None
        full = min(req.num_prompt_tokens // ps, len(req.kv.pages))
        if full <= req.kv.shared_pages:
            return
        node, dup = tree.insert(req.token_ids, req.kv.pages[:full], req.kv.shared_pages, req.cache_namespace)
        path, n = [], node
        while n is not tree.root:
            path.append(n.page)
            n = n.parent
        req.kv.pages[:full] = path[::-1]
        if dup:
            self.pool.allocator.free(dup)
        tree.lock(node)
        if req.kv.prefix_node is not None:
            tree.unlock(req.kv.prefix_node)
        req.kv.prefix_node, req.kv.shared_pages = node, full

    @staticmethod
    def _head(req: Req) -> int:
        """Leading entries of req.kv.pages that are not its own: trimmed (0) or the cache's (shared)."""
        return max(req.kv.dropped_pages, req.kv.shared_pages)

    def can_offload(self, req: Req) -> bool:
        return self.host.can_hold(len(req.kv.pages) - req.kv.dropped_pages)

    def offload(self, req: Req) -> None:
        """Retract: copy the request's live KV pages to the host pool and free its own device pages.
        Shared (cached) pages are copied too and unlocked, not freed: a retracted request holds
        nothing on the device (two retracted requests' locks could otherwise starve each other's
        reload), and reload gives it fresh pages for all of them."""
        live = req.kv.pages[req.kv.dropped_pages :]
        assert live and not req.kv.host_pages
        req.kv.host_pages = self.host.offload(self.pool, live)
        self.pool.allocator.free(req.kv.pages[self._head(req) :])
        self._unlock(req)
        req.kv.pages = req.kv.pages[: req.kv.dropped_pages]
        if self.states is not None and req.kv.state_slot >= 0:  # the state goes with the KV
            saved = self.states.save(req.kv.state_slot)
            self._free_slot(req)
            req.kv.host_state = saved
        req.kv.retractions += 1
        self.retractions += 1

    def can_reload(self, req: Req, extra_tokens: int = 1) -> bool:
        return pages_for(req.kv.kv_len + extra_tokens, self.page_size) - len(req.kv.pages) <= self.free_pages \
            and (self.states is None or req.kv.host_state is None or self.free_slots > 0)

    def reload(self, req: Req) -> None:
        """Bring a retracted request's KV back into fresh device pages; host pages are freed."""
        assert req.kv.host_pages and len(req.kv.pages) == req.kv.dropped_pages
        pages = self._allocate(len(req.kv.host_pages))
        self.host.reload(self.pool, req.kv.host_pages, pages)
        req.kv.pages = req.kv.pages + pages
        req.kv.host_pages = []
        if req.kv.host_state is not None:
            saved, req.kv.host_state = req.kv.host_state, None
            req.kv.state_slot = self.states.allocate(1)[0]  # type: ignore[union-attr]
            self.states.load(req.kv.state_slot, saved)  # type: ignore[union-attr]
        self.reloads += 1

    def all_free(self) -> bool:
        return self.pool.allocator.all_free() and self.host.all_free() and \
            (self.states is None or self.states.all_free())
