"""KV cache events (issue 52, docs/kv_events.md): vLLM's wire format, the radix tree's hooks, the
publisher's queue and replay.

- A decoder written from vLLM's documented schema (vllm/distributed/kv_events.py: KVEventBatch and its
  tagged structs, in both encodings), with plain msgpack, decodes what the publisher sends.
- After random inserts, matches, evictions and a flush (plain tree; and a host tier over a tiny pool:
  evictions to the host, loads back, host evictions), the hashes stored minus removed, per medium,
  are those of the pages the tree holds there; the hashes are `block_hashes` of the inserted ids.
- The scheduler's side drops (and counts) rather than blocks when the queue is full.
- Replay from a sequence number returns the buffered batches from there, then the end marker.
"""

from __future__ import annotations

import hashlib
import random
import time

import msgpack
import pytest
import torch
import zmq

from engine.kvcache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
    block_hashes,
    page_hash,
    root_hash,
)
from engine.kvcache.hicache import HiCacheSpec, HiRadixCache
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.memory import HostKVPool, KVPool
from engine.kvcache.radix_cache import Node, RadixCache
from engine.request import Req
from engine.sampling.params import SamplingParams
from service.kv_events import ZmqEventPublisher, encode_batch
from tests.kv_events_client import replay

PS = 4

# ---- a consumer's decoder, from vLLM's schema (not from service/kv_events.py) -------------------------
# msgspec structs with omit_defaults: array_like ones are [tag, field, ...] with trailing defaults left
# out; map ones {"type": tag, field: value}. Fields without a default are required.
SCHEMA = {
    "BlockStored": (["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                     "lora_name"], ["extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]),
    "BlockRemoved": (["block_hashes", "medium"], ["group_idx"]),
    "AllBlocksCleared": ([], []),
}


def decode_event(raw: list | dict) -> dict:
    if isinstance(raw, dict):
        tag, given = raw["type"], {k: v for k, v in raw.items() if k != "type"}
    else:
        tag, values = raw[0], raw[1:]
        required, optional = SCHEMA[raw[0]]
        assert len(required) <= len(values) <= len(required) + len(optional), raw
        given = dict(zip(required + optional, values))
    required, optional = SCHEMA[tag]
    assert set(required) <= set(given) <= set(required) | set(optional), (tag, sorted(given))
    ev = {"type": tag, **dict.fromkeys(optional), **given}
    if tag != "AllBlocksCleared":
        assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in ev["block_hashes"])
    if tag == "BlockStored":
        assert len(ev["token_ids"]) == ev["block_size"] * len(ev["block_hashes"])
        assert ev["parent_block_hash"] is None or isinstance(ev["parent_block_hash"], int)
    return ev


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """KVEventBatch: [ts, events] or [ts, events, data_parallel_rank]."""
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, list) and len(batch) in (2, 3) and isinstance(batch[0], float)
    return batch[0], [decode_event(e) for e in batch[1]], batch[2] if len(batch) == 3 else None


@pytest.mark.parametrize("encoding", ["array", "map"])
def test_vllm_schema_decodes_a_batch(encoding: str) -> None:
    events = [BlockStored([11, 12], None, list(range(8)), 4, None, "GPU", None),
              BlockStored([13], 12, [8, 9, 10, 11], 4, None, "CPU", "ad", [("ad\x1fs",)]),
              BlockRemoved([11], "GPU"), AllBlocksCleared()]
    ts, got, rank = decode_batch(encode_batch(123.5, events, 0, encoding))
    assert (ts, rank) == (123.5, 0)
    assert [e["type"] for e in got] == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert got[0] | {"extra_keys": None} == {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
                                              "token_ids": list(range(8)), "block_size": 4, "lora_id": None,
                                              "medium": "GPU", "lora_name": None, "extra_keys": None,
                                              "group_idx": None, "kv_cache_spec_kind": None,
                                              "kv_cache_spec_sliding_window": None}
    assert (got[1]["parent_block_hash"], got[1]["lora_name"], got[1]["extra_keys"]) == (12, "ad", [["ad\x1fs"]])
    assert (got[2]["block_hashes"], got[2]["medium"]) == ([11], "GPU")
    if encoding == "array":  # vLLM's positional layout, exactly
        raw = msgpack.unpackb(encode_batch(1.0, events[:1] + events[2:], 0))
        assert raw[1] == [["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU", None],
                          ["BlockRemoved", [11], "GPU"], ["AllBlocksCleared"]]


# ---- hashes ---------------------------------------------------------------------------------------------
def test_block_hashes_are_chained_pinned_and_namespaced() -> None:
    ids = list(range(1, 11))
    hs = block_hashes(ids, PS)
    assert len(hs) == 2  # the partial last page has none
    assert hs[0] == page_hash(root_hash(""), ids[:4]) and hs[1] == page_hash(hs[0], ids[4:8])
    assert hs == block_hashes(ids[:8], PS)  # a prefix's hashes are the prefix of the hashes
    assert block_hashes(ids, PS, "lora\x1fsalt")[0] != hs[0]  # another adapter or salt: other hashes

    def h(b: bytes) -> int:  # the documented definition, by hand (docs/kv_events.md)
        return int.from_bytes(hashlib.sha256(b).digest()[:8], "big")

    assert block_hashes(list(range(1, 9)), PS) == [3507725161548493009, 15389091419626935696]  # pinned
    root = h(b"pdserve-kv-root\0")
    assert hs[0] == h(root.to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in ids[:4]))


# ---- the tree's hooks -----------------------------------------------------------------------------------
class Index:
    """What a consumer keeps: hashes per medium, from the events in order."""

    def __init__(self) -> None:
        self.media: dict[str, set[int]] = {}
        self.parents: dict[int, int | None] = {}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                held = self.media.setdefault(e.medium, set())
                assert not held & set(e.block_hashes), "stored twice on one medium"
                held.update(e.block_hashes)
                assert e.parent_block_hash is None or e.parent_block_hash in self.parents
                for i, h in enumerate(e.block_hashes):
                    self.parents[h] = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
            elif isinstance(e, BlockRemoved):
                held = self.media.setdefault(e.medium, set())
                assert set(e.block_hashes) <= held, "removed what was not stored"
                held.difference_update(e.block_hashes)
            else:
                self.media.clear()


def _nodes(cache: RadixCache) -> list[Node]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.children.values())
    return out


def _drain(rec: KVEventRecorder) -> list:
    return rec.take(1 << 20, 0) if not rec.queue.empty() else []


def test_tree_events_match_the_tree_after_random_traffic() -> None:
    rng = random.Random(7)
    free: list[int] = list(range(1, 200))
    cache = RadixCache(PS, free.extend)
    rec = KVEventRecorder(PS)
    cache.events = rec
    index, locked = Index(), []
    for step in range(400):
        op = rng.random()
        if op < 0.5:  # a request computes and releases a prompt (shared prefixes, 2 namespaces)
            ns = rng.choice(["", "lora\x1fsalt"])
            ids = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
            hit = cache.match(ids, namespace=ns)
            n_full = len(ids) // PS
            if len(free) < n_full:
                cache.evict(n_full - len(free))
            if len(free) < n_full:
                continue
            pages = hit.pages + [free.pop() for _ in range(n_full - len(hit.pages))]
            _, dup = cache.insert(ids, pages, len(hit.pages), ns)
            free.extend(dup)
            if n_full:
                assert block_hashes(ids, PS, ns) == [rec.node_hash(n) for n in _path(cache, ids, ns)]
        elif op < 0.65:  # a running request locks its match
            m = cache.match([rng.randrange(3) for _ in range(12)])
            cache.lock(m.node)
            locked.append(m.node)
        elif op < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randrange(1, 6))
        index.apply(_drain(rec))
        assert index.media.get("GPU", set()) == {n.block_hash for n in _nodes(cache)}, step
    for node in locked:
        cache.unlock(node)
    cache.flush()
    events = _drain(rec)
    assert isinstance(events[-1], AllBlocksCleared)
    index.apply(events)
    assert not _nodes(cache) and index.media == {}


def _path(cache: RadixCache, ids: list[int], ns: str) -> list[Node]:
    node, out = cache.root, []
    for key in cache._keys(ids, len(ids), ns):
        node = node.children[key]
        out.append(node)
    return out


def _hikv(pages: int, host_tokens: int, policy: str) -> KVManager:
    pool = KVPool(num_pages=pages, num_layers=1, page_size=PS, num_kv_heads=1, head_dim=2,
                  dtype=torch.float32, device="cpu")
    host = HostKVPool(0, tuple(pool.buffer.shape[1:]), torch.float32, pin=False)
    return KVManager(pool, host, prefix_cache=True, hicache=HiCacheSpec(host_tokens=host_tokens, write_policy=policy))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_host_tier_moves_are_reported_per_medium(policy: str) -> None:
    rng = random.Random(3)
    kv = _hikv(pages=12, host_tokens=32, policy=policy)
    cache = kv.cache
    assert isinstance(cache, HiRadixCache)
    rec = KVEventRecorder(PS)
    cache.events = rec
    index = Index()
    convs = [[rng.randrange(50) for _ in range(16)] for _ in range(5)]  # 5 conversations: their prefixes come back
    for step in range(120):
        ids = rng.choice(convs)[: rng.randrange(4, 17)] + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        r = Req(rid=str(step), token_ids=ids, sampling=SamplingParams())
        kv.match(r)  # loads host pages back to the device
        kv.grow(r, len(ids) - r.kv.kv_len)  # evicts device pages to the host, the host's LRU out
        r.kv.kv_len = len(ids)
        kv.release(r)
        index.apply(_drain(rec))
        nodes = _nodes(cache)
        assert index.media.get("GPU", set()) == {n.block_hash for n in nodes if n.page >= 0}, step
        assert index.media.get("CPU", set()) == {n.block_hash for n in nodes if n.host >= 0}, step
    assert cache.evictions["device"] and cache.hits["host"]  # both moves happened
    kv.flush()
    index.apply(_drain(rec))
    assert index.media == {}


# ---- the queue and the publisher ------------------------------------------------------------------------
def test_a_full_queue_drops_and_counts_instead_of_blocking() -> None:
    rec = KVEventRecorder(PS, max_events=2)
    t0 = time.perf_counter()
    for _ in range(5):
        rec.cleared()
    assert time.perf_counter() - t0 < 0.5
    assert rec.dropped == 3 and len(rec.take(10, 0)) == 2


def _publish(pub: ZmqEventPublisher, rec: KVEventRecorder, n: int) -> None:
    """n batches, one event each (waits for each to be sent)."""
    for i in range(n):
        want = pub.seq + 1
        rec.removed([_hashed(i)], "GPU")
        deadline = time.monotonic() + 5
        while pub.seq < want:
            assert time.monotonic() < deadline, "the publisher sent nothing"
            time.sleep(0.005)


def _hashed(h: int) -> Node:
    n = Node(None, (h,), 1)
    n.block_hash = h
    return n


def test_pub_frames_and_replay_from_a_sequence() -> None:
    rec = KVEventRecorder(PS)
    pub = ZmqEventPublisher(rec, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", buffer_batches=4)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.linger = 0
    try:
        sub.connect(pub.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        deadline = time.monotonic() + 5  # a slow joiner: publish until the SUB hears something
        while not sub.poll(50):
            assert time.monotonic() < deadline
            _publish(pub, rec, 1)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and len(seq) == 8
        _, events, _ = decode_batch(payload)
        assert events[0]["type"] == "BlockRemoved"
        first = pub.seq
        _publish(pub, rec, 3)
        got = replay(pub.replay_endpoint, first + 1)
        assert [s for s, _ in got] == [first + 1, first + 2]
        assert [decode_batch(p)[1][0]["block_hashes"] for _, p in got] == [[1], [2]]
        got = replay(pub.replay_endpoint, 0)  # the buffer keeps the last 4 batches
        assert [s for s, _ in got] == list(range(pub.seq - 4, pub.seq))
        assert replay(pub.replay_endpoint, pub.seq) == []  # nothing missed: the end marker alone
    finally:
        sub.close()
        pub.close()
