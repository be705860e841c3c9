"""The router's global KV index, fed by the workers' KV cache events (docs/kv_events.md, "the router's index").

Per worker URL and per medium ("GPU" the device tier, "CPU" the host tier), the set of block hashes the
worker reported stored and not yet removed, with each block's parent. `longest_prefix(url, hashes)` walks a
request's chained hashes (common.kv_hashing.block_hashes) until the worker lacks one. Sequence numbers:
  1. a batch whose sequence is the next one expected is applied;
  2. one below it is a duplicate (a replayed batch seen again) and is skipped, except 0 after more than
     0: the worker restarted, its entries go and the batch is applied;
  3. one above it is a gap: the subscriber asks the worker's replay socket from the first missing
     number; when the replay cannot cover the gap (no replay socket, or the worker's buffer moved on),
     the worker's entries are cleared (`stale_clears`), since removals may have been missed.
A worker that is ejected, removed or advertises another endpoint loses its entries (`forget`).

Routed, not yet reported: a request's blocks are stored only once its prefill ran, and its events arrive after
that; a burst of requests with one prefix would each find no worker holding it and scatter. So the router
records the blocks of each request it routes to a worker (`record_routed`) as pending there for PENDING_S;
lookups count a pending block as held on the device, the worker's own BlockStored or BlockRemoved for it
replaces the guess, and an unconfirmed guess expires (a request that failed, or whose pages were evicted before
they were reported).
The index is plain Python on the event loop (no locks); `KVSubscribers` runs one zmq.asyncio SUB task
per worker that advertises `kv_events` in /server_info.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgpack
import zmq
import zmq.asyncio

from common.kv_hashing import block_hashes, namespace
from router.registry import Worker

log = logging.getLogger("router.kv_index")
GPU, CPU = "GPU", "CPU"
END_SEQ = -1
REPLAY_TIMEOUT_S = 2.0
PENDING_S = 10.0  # how long a routed request's blocks count as held before the worker's events confirm them


class ExactPrompt(NamedTuple):
    """What the router needs to hash a request's pages as a worker does: its token ids, cache salt and
    the LoRA adapter it names (a worker's namespace uses it only when that worker holds the adapter)."""

    token_ids: list[int]
    cache_salt: str = ""
    adapter: str = ""


@dataclass
class WorkerBlocks:
    """One worker's blocks and the bookkeeping /admin/kv_index shows."""

    endpoint: str = ""
    block_size: int = 0
    media: dict[str, dict[int, int | None]] = field(default_factory=lambda: {GPU: {}, CPU: {}})  # hash -> parent
    next_seq: int | None = None  # the sequence expected next (None: nothing seen yet)
    events: int = 0
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    stale_clears: int = 0  # clears because a gap could not be replayed
    restarts: int = 0
    predicted_tokens: int = 0
    reported_tokens: int = 0
    pending: dict[int, float] = field(default_factory=dict)  # hash -> expiry: routed here, not yet reported
    expiries: deque = field(default_factory=deque)  # (expiry, hash) in expiry order, to drop the stale ones

    def clear(self) -> None:
        for blocks in self.media.values():
            blocks.clear()
        self.pending.clear()
        self.expiries.clear()

    def expire(self, now: float) -> None:
        """Drop the pending blocks whose time ran out unconfirmed."""
        q, pending = self.expiries, self.pending
        while q and q[0][0] <= now:
            t, h = q.popleft()
            if pending.get(h) == t:
                del pending[h]

    def to_json(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "block_size": self.block_size,
                "blocks": {m: len(b) for m, b in self.media.items()},
                "last_seq": None if self.next_seq is None else self.next_seq - 1, "events": self.events,
                "batches": self.batches, "gaps": self.gaps, "replays": self.replays,
                "stale_clears": self.stale_clears, "restarts": self.restarts, "pending_blocks": len(self.pending),
                "predicted_cached_tokens": self.predicted_tokens, "reported_cached_tokens": self.reported_tokens}


def _fields(e: Any) -> tuple[str, list]:
    """(tag, positional fields) of an event in either encoding ("array": [tag, ...]; "map": {"type": tag, ...})."""
    if isinstance(e, dict):
        tag = e.get("type", "")
        if tag == "BlockStored":
            return tag, [e.get("block_hashes", []), e.get("parent_block_hash"), None, None, None, e.get("medium")]
        if tag == "BlockRemoved":
            return tag, [e.get("block_hashes", []), e.get("medium")]
        return tag, []
    return e[0], list(e[1:])


def _held_prefix(hashes: list[int], lo: int, a: dict, b: dict | None = None) -> int:
    """The first i >= lo whose hash is in neither `a` nor `b` (len(hashes) when all are), for sets that hold
    a prefix of `hashes` (binary search)."""
    hi = len(hashes)
    while lo < hi:
        mid = (lo + hi) // 2
        h = hashes[mid]
        if h in a or (b is not None and h in b):
            lo = mid + 1
        else:
            hi = mid
    return lo


def _hashes(w: WorkerBlocks, prompt: ExactPrompt, loras: frozenset[str],
            memo: dict[tuple[int, str], list[int]] | None) -> list[int]:
    """The prompt's page hashes as worker `w` names them: its block size and namespace (the adapter counts only
    when the worker holds it); `memo` shares them between the workers of one pick."""
    key = (w.block_size, namespace(prompt.adapter if prompt.adapter in loras else "", prompt.cache_salt))
    hashes = memo.get(key) if memo is not None else None
    if hashes is None:
        hashes = block_hashes(prompt.token_ids, *key)
        if memo is not None:
            memo[key] = hashes
    return hashes


class KVIndex:
    """Every worker's blocks, by URL (see the module docstring for the sequence rules)."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerBlocks] = {}
        self.predicted_total = 0  # over every worker ever indexed (the metrics' counters)
        self.reported_total = 0

    def worker(self, url: str, endpoint: str = "", block_size: int = 0) -> WorkerBlocks:
        """The worker's entry; a new `endpoint` (a restarted worker) starts it over."""
        w = self.workers.get(url)
        if w is None or (endpoint and w.endpoint and endpoint != w.endpoint):
            w = self.workers[url] = WorkerBlocks(endpoint, block_size)
        w.endpoint, w.block_size = endpoint or w.endpoint, block_size or w.block_size
        return w

    def forget(self, url: str) -> None:
        self.workers.pop(url, None)

    # ---- events ------------------------------------------------------------------------------------
    def check_seq(self, url: str, seq: int) -> str:
        """"apply", "skip" (a duplicate) or "gap" (ask the replay from `next_seq`) for a batch numbered `seq`;
        a restart (0 after more) clears the worker and answers "apply"."""
        w = self.worker(url)
        if w.next_seq is None:
            return "apply" if seq == 0 else "gap"  # joined late: replay from 0
        if seq == w.next_seq:
            return "apply"
        if seq == 0:
            w.clear()
            w.restarts += 1
            w.next_seq = None
            return "apply"
        return "skip" if seq < w.next_seq else "gap"

    def apply_batch(self, url: str, seq: int, payload: bytes) -> None:
        """Apply one KVEventBatch payload ([ts, events, dp_rank]) numbered `seq`."""
        batch = msgpack.unpackb(payload, strict_map_key=False)
        self.apply_events(url, batch[1])
        w = self.workers[url]
        w.next_seq, w.batches = seq + 1, w.batches + 1

    def apply_events(self, url: str, events: Iterable[Any]) -> None:
        w = self.worker(url)
        media = w.media
        for e in events:
            tag, f = _fields(e)
            w.events += 1
            if tag == "BlockStored":
                blocks = media.setdefault(f[5] or GPU, {})
                parent = f[1]
                for h in f[0]:
                    blocks[h] = parent
                    parent = h
                    w.pending.pop(h, None)  # reported: no longer a guess
            elif tag == "BlockRemoved":
                blocks = media.setdefault(f[1] or GPU, {})
                for h in f[0]:
                    blocks.pop(h, None)
                    w.pending.pop(h, None)
            elif tag == "AllBlocksCleared":
                w.clear()

    def lost(self, url: str, expected: int) -> None:
        """A gap from `expected` that no replay covers: the worker's entries may be wrong, so they go."""
        w = self.worker(url)
        w.clear()
        w.stale_clears += 1
        log.warning("kv index: %s missed batches from %d that no replay covers: its entries are cleared", url,
                    expected)

    # ---- lookups -----------------------------------------------------------------------------------
    def longest_prefix(self, url: str, hashes: list[int]) -> tuple[int, int]:
        """(device_blocks, host_blocks): the leading blocks of `hashes` the worker holds on the device, and how
        many more leading blocks after those it holds on the host tier (loadable without recompute).

        A radix tree holds prefixes: when it holds a page it holds the page's parent on that tier or a
        faster one (it evicts leaves first, and a host copy is taken before the device page goes), so
        "block i is held" is true up to some i and false after: a binary search (log2(pages) lookups)."""
        w = self.workers.get(url)
        if w is None:
            return 0, 0
        gpu, cpu, pending = w.media[GPU], w.media[CPU], w.pending
        if pending:
            w.expire(time.monotonic())
        if not hashes or (hashes[0] not in gpu and hashes[0] not in cpu and hashes[0] not in pending):
            return 0, 0  # the common case: not even the first page
        device = _held_prefix(hashes, 0, gpu, pending) if pending else _held_prefix(hashes, 0, gpu)
        either = _held_prefix(hashes, device, cpu, gpu) if cpu else device
        return device, either - device

    def prefix_of(self, url: str, prompt: ExactPrompt, loras: frozenset[str] = frozenset(),
                  memo: dict[tuple[int, str], list[int]] | None = None) -> tuple[int, int, int] | None:
        """(device_blocks, host_blocks, block_size) of the request at the worker at `url` (None: no events
        from it), its pages hashed with the worker's block size and namespace (the adapter counts only when the
        worker holds it). `memo` shares the hashes between the workers of one pick."""
        w = self.workers.get(url)
        if w is None or not w.block_size:
            return None
        return (*self.longest_prefix(url, _hashes(w, prompt, loras, memo)), w.block_size)

    def record_routed(self, url: str, prompt: ExactPrompt, loras: frozenset[str] = frozenset(),
                      memo: dict[tuple[int, str], list[int]] | None = None, now: float | None = None) -> None:
        """The request was routed to the worker at `url`: its whole pages count as held there (pending) until
        the worker reports them or PENDING_S pass. Nothing for a worker without events."""
        w = self.workers.get(url)
        if w is None or not w.block_size:
            return
        hashes = _hashes(w, prompt, loras, memo)
        now = time.monotonic() if now is None else now
        w.expire(now)
        t = now + PENDING_S
        gpu = w.media[GPU]
        for h in hashes:
            if h not in gpu:
                w.pending[h] = t
                w.expiries.append((t, h))

    def held_tokens(self, url: str) -> int | None:
        """Tokens the worker at `url` holds on its device (blocks x block size; None: no events from it)."""
        w = self.workers.get(url)
        return None if w is None or not w.block_size else len(w.media[GPU]) * w.block_size

    def record_predicted(self, url: str, tokens: int) -> None:
        """The cached prompt tokens the index predicted for a request routed to the worker at `url`."""
        w = self.workers.get(url)
        if w is not None:
            w.predicted_tokens += tokens
            self.predicted_total += tokens

    def record_reported(self, url: str, tokens: int | None) -> None:
        """The cached prompt tokens the worker reported for it (only for workers with events)."""
        w = self.workers.get(url)
        if w is not None and w.block_size and tokens is not None:
            w.reported_tokens += tokens
            self.reported_total += tokens

    def to_json(self) -> dict[str, Any]:
        return {"workers": {url: w.to_json() for url, w in sorted(self.workers.items())}}


class KVSubscribers:
    """One SUB task per worker advertising `kv_events`; `watch(url, info)` (re)starts it when the advertised
    endpoint changes, `drop(url)` stops it and forgets the worker's entries."""

    def __init__(self, index: KVIndex, replay_timeout_s: float = REPLAY_TIMEOUT_S) -> None:
        self.index = index
        self.replay_timeout_s = replay_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}

    def watch(self, url: str, info: dict[str, Any]) -> None:
        ev = info.get("kv_events")
        if not isinstance(ev, dict) or not ev.get("endpoint"):
            return
        endpoint = str(ev["endpoint"])
        cur = self._tasks.get(url)
        if cur is not None and cur[0] == endpoint and not cur[1].done():
            return
        self.drop(url)
        self.index.worker(url, endpoint, int(ev.get("block_size") or 0))
        task = asyncio.get_running_loop().create_task(self._run(url, ev), name=f"kv-events {url}")
        self._tasks[url] = (endpoint, task)
        log.info("subscribed to %s's KV events at %s", url, endpoint)

    def watch_worker(self, w: Worker, info: dict[str, Any]) -> None:
        """router.health's hook: a worker's /server_info, read at its admission."""
        self.watch(w.url, info)

    def drop(self, url: str) -> None:
        cur = self._tasks.pop(url, None)
        if cur is not None:
            cur[1].cancel()
        self.index.forget(url)

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._ctx.destroy(linger=0)

    async def _run(self, url: str, ev: dict[str, Any]) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.linger = 0
        sub.connect(str(ev["endpoint"]))
        sub.setsockopt(zmq.SUBSCRIBE, str(ev.get("topic") or "").encode())
        replay = str(ev.get("replay_endpoint") or "")
        try:
            while True:
                _topic, seq_b, payload = await sub.recv_multipart()
                await self.on_batch(url, replay, int.from_bytes(seq_b, "big"), payload)
        except asyncio.CancelledError:
            raise
        except (zmq.ZMQError, ValueError, IndexError, TypeError, KeyError) as e:
            log.warning("KV events of %s stopped: %r", url, e)
        finally:
            sub.close(linger=0)

    async def on_batch(self, url: str, replay: str, seq: int, payload: bytes) -> None:
        """One live batch: applied, skipped (a duplicate), or after a gap the missing ones are replayed
        first (from `replay`; when that fails the worker's entries are cleared and counted)."""
        verdict = self.index.check_seq(url, seq)
        if verdict == "apply":
            self.index.apply_batch(url, seq, payload)
            return
        if verdict == "skip":
            return
        w = self.index.worker(url)
        start = w.next_seq or 0
        w.gaps += 1
        if not await self._replay(url, replay, start, seq):
            self.index.lost(url, start)
        w.next_seq = seq
        self.index.apply_batch(url, seq, payload)

    async def _replay(self, url: str, endpoint: str, start: int, until: int) -> bool:
        """Apply batches start..until-1 from the worker's replay socket; False when it cannot give them all."""
        if not endpoint:
            return False
        self.index.worker(url).replays += 1
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.linger = 0
        expected = start
        try:
            dealer.connect(endpoint)
            await dealer.send(start.to_bytes(8, "big"))
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), self.replay_timeout_s)
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_SEQ:
                    return expected == until
                if expected <= seq < until:
                    if seq > expected:
                        return False  # the worker's buffer no longer holds `expected`
                    self.index.apply_batch(url, seq, frames[1])
                    expected = seq + 1
        except (asyncio.TimeoutError, zmq.ZMQError) as e:
            log.warning("KV events replay from %s failed: %r", endpoint, e)
            return False
        finally:
            dealer.close(linger=0)


def cached_tokens_of(body: Any) -> int | None:
    """`cached_tokens` of a worker's JSON answer: /generate's `meta_info`, OpenAI's `usage.prompt_tokens_details`
    (a list, /generate with n > 1: the first)."""
    if isinstance(body, list):
        body = body[0] if body else None
    if not isinstance(body, dict):
        return None
    meta = body.get("meta_info")
    if isinstance(meta, dict) and isinstance(meta.get("cached_tokens"), int):
        return meta["cached_tokens"]
    details = (body.get("usage") or {}).get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]
    return None
