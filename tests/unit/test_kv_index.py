"""The router's KV index (router/kv_index.py): events in, longest prefixes out; sequence gaps replayed over a
real zmq ROUTER socket (service.kv_events's publisher), worker removal, and the cache_aware policy scoring
by events where the approximate tree would pick wrong."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest

from common.kv_hashing import block_hashes, namespace
from engine.kvcache.events import BlockRemoved, BlockStored, KVEventRecorder, hashing
from router.config import WorkerSpec
from router.kv_index import CPU, GPU, ExactPrompt, KVIndex, KVSubscribers, cached_tokens_of
from router.policies import CacheAware
from router.prefix_index import PrefixIndex
from router.protocol import parse_request
from router.registry import Worker
from service.kv_events import ZmqEventPublisher, encode_batch

URL = "http://w:1"
PAGE = 4


def _stored(hashes: list[int], parent: int | None = None, medium: str = GPU) -> list:
    return ["BlockStored", hashes, parent, [0] * PAGE * len(hashes), PAGE, None, medium, None]


def _batch(*events: list | dict) -> bytes:
    return msgpack.packb([time.time(), list(events), 0])


def _index() -> KVIndex:
    kv = KVIndex()
    kv.worker(URL, "tcp://w:5557", PAGE)
    return kv


def test_hashes_are_the_engine_ones():
    assert hashing.block_hashes is block_hashes
    assert block_hashes(list(range(1, 9)), 4) == [3507725161548493009, 15389091419626935696]
    assert namespace() == "" and namespace("lora", "") == "lora\x1f" and namespace("", "s") == "\x1fs"


def test_apply_store_remove_clear_and_longest_prefix():
    kv = _index()
    h = block_hashes(list(range(16)), PAGE)  # 4 pages
    kv.apply_batch(URL, 0, _batch(_stored(h[:2]), _stored(h[2:3], h[1])))
    assert kv.longest_prefix(URL, h) == (3, 0)
    kv.apply_batch(URL, 1, _batch(["BlockRemoved", [h[2]], GPU], _stored([h[2]], h[1], CPU)))
    assert kv.longest_prefix(URL, h) == (2, 1)  # page 2 moved to the host tier
    assert kv.workers[URL].media[GPU][h[1]] == h[0]  # parent links kept
    kv.apply_batch(URL, 2, _batch({"type": "BlockRemoved", "block_hashes": [h[1], h[0]], "medium": GPU},  # map
                                  _stored(h[:2], None, CPU)))
    assert kv.longest_prefix(URL, h) == (0, 3)  # all three on the host tier now
    kv.apply_batch(URL, 3, _batch(["BlockRemoved", h[:3], CPU]))
    assert kv.longest_prefix(URL, h) == (0, 0)
    assert kv.longest_prefix(URL, h[:0]) == (0, 0)
    kv.apply_batch(URL, 4, _batch(_stored(h[:1]), ["AllBlocksCleared"]))
    assert kv.workers[URL].to_json()["blocks"] == {GPU: 0, CPU: 0}
    assert kv.workers[URL].to_json()["last_seq"] == 4 and kv.workers[URL].events == 9
    assert kv.longest_prefix("http://unknown:1", h) == (0, 0)


def test_recorder_events_index_as_the_router_hashes_them():
    """What a worker's recorder emits, encoded as on the wire, matches `block_hashes` of the request."""
    rec = KVEventRecorder(PAGE)
    ids = list(range(100, 112))
    h = block_hashes(ids, PAGE, "lora\x1fsalt")
    rec._put(BlockStored(h, None, ids, PAGE, None, GPU, "lora", [("lora\x1fsalt",), None, None]))
    rec._put(BlockRemoved([h[2]], GPU))
    kv = _index()
    kv.apply_batch(URL, 0, encode_batch(time.time(), rec.take(10, 0.1), 0, "map"))
    assert kv.prefix_of(URL, ExactPrompt(ids, "salt", "lora"), frozenset({"lora"})) == (2, 0, PAGE)
    assert kv.prefix_of(URL, ExactPrompt(ids, "salt", "lora")) == (0, 0, PAGE)  # the worker lacks the adapter
    assert kv.prefix_of("http://other:1", ExactPrompt(ids)) is None


def test_sequence_rules_restart_and_duplicates():
    kv = _index()
    assert kv.check_seq(URL, 3) == "gap"  # joined late: replay from 0
    kv.apply_batch(URL, 0, _batch(_stored([1, 2])))
    assert kv.check_seq(URL, 1) == "apply" and kv.check_seq(URL, 5) == "gap"
    kv.apply_batch(URL, 1, _batch(_stored([3], 2)))
    assert kv.check_seq(URL, 1) == "skip"  # seen already (a replayed batch again)
    assert kv.check_seq(URL, 0) == "apply"  # the worker restarted: its entries are gone
    w = kv.workers[URL]
    assert w.restarts == 1 and not w.media[GPU] and w.next_seq is None
    kv.worker(URL, "tcp://w:6000")  # a new endpoint: a new process, a new entry
    assert kv.workers[URL].endpoint == "tcp://w:6000" and kv.workers[URL].block_size == 0
    kv.forget(URL)
    assert URL not in kv.workers


@pytest.fixture
def publisher():
    rec = KVEventRecorder(PAGE)
    pub = ZmqEventPublisher(rec, "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_batches=4)
    yield rec, pub
    pub.close()


def _publish(rec: KVEventRecorder, pub: ZmqEventPublisher, n: int) -> None:
    start = pub.seq
    for i in range(n):
        rec._put(BlockStored([1000 + start + i], None, [0] * PAGE, PAGE, None, GPU, None))
        deadline = time.monotonic() + 5
        while pub.seq < start + i + 1 and time.monotonic() < deadline:
            time.sleep(0.005)


async def test_gap_is_replayed_and_an_uncovered_gap_clears(publisher):
    rec, pub = publisher
    kv = _index()
    subs = KVSubscribers(kv, replay_timeout_s=2.0)
    try:
        _publish(rec, pub, 3)  # batches 0..2, all in the replay buffer (4)
        buf = dict(pub.buffer)
        await subs.on_batch(URL, pub.replay_endpoint, 0, buf[0])
        await subs.on_batch(URL, pub.replay_endpoint, 2, buf[2])  # 1 lost: replayed
        w = kv.workers[URL]
        assert (w.gaps, w.replays, w.stale_clears, w.next_seq) == (1, 1, 0, 3)
        assert set(w.media[GPU]) == {1000, 1001, 1002}
        _publish(rec, pub, 6)  # batches 3..8: the buffer keeps 5..8, so 3 and 4 are gone
        buf = dict(pub.buffer)
        await subs.on_batch(URL, pub.replay_endpoint, 8, buf[8])
        assert (w.gaps, w.replays, w.stale_clears, w.next_seq) == (2, 2, 1, 9)
        assert set(w.media[GPU]) == {1008}  # cleared, then batch 8 applied
        await subs.on_batch(URL, "", 10, _batch(_stored([7])))  # no replay socket: cleared too
        assert w.stale_clears == 2 and set(w.media[GPU]) == {7}
    finally:
        await subs.close()


async def test_subscriber_follows_the_publisher_and_drop_forgets(publisher):
    rec, pub = publisher
    kv = KVIndex()
    subs = KVSubscribers(kv)
    try:
        subs.watch(URL, pub.info("127.0.0.1"))
        await asyncio.sleep(0.3)  # the SUB connects (PUB drops what it sends before)
        await asyncio.to_thread(_publish, rec, pub, 3)
        for _ in range(100):
            if kv.workers[URL].next_seq == 3:
                break
            await asyncio.sleep(0.02)
        assert set(kv.workers[URL].media[GPU]) == {1000, 1001, 1002}
        assert kv.workers[URL].block_size == PAGE
        subs.drop(URL)  # ejected or removed
        assert URL not in kv.workers
    finally:
        await subs.close()


def _worker(url: str) -> Worker:
    return Worker(spec=WorkerSpec(url, "prefill", bootstrap_port=1), healthy=True)


def test_policy_follows_events_where_the_approximate_tree_is_wrong():
    """A and B both publish events. The prompt went to A first (the tree says A), A evicted it and B
    computed it (events say B): the policy picks B; the tree alone picks A."""
    a, b = _worker("http://a:1"), _worker("http://b:1")
    ids = list(range(64))
    h = block_hashes(ids, PAGE)
    prefix = ",".join(map(str, ids))
    tree_only = CacheAware(PrefixIndex(block_chars=8))
    tree_only.index.insert(a.url, tree_only.index.chain(prefix))
    assert tree_only.pick([a, b], prefix) is a

    kv = KVIndex()
    for w in (a, b):
        kv.worker(w.url, f"tcp://{w.url[7:8]}:1", PAGE)
    ca = CacheAware(PrefixIndex(block_chars=8), kv=kv, predicts=True)
    ca.index.insert(a.url, ca.index.chain(prefix))
    kv.apply_batch(a.url, 0, _batch(_stored(h)))
    kv.apply_batch(a.url, 1, _batch(["BlockRemoved", h, GPU]))
    kv.apply_batch(b.url, 0, _batch(_stored(h)))
    exact = ExactPrompt(ids)
    assert ca.pick([a, b], prefix, exact) is b
    assert kv.workers[b.url].predicted_tokens == len(ids)
    assert ca.pick([a, b], prefix) is a  # no token ids (a text prompt): the tree decides
    # a worker without events is scored by the tree, next to one with events
    c = _worker("http://c:1")
    ca.index.insert(c.url, ca.index.chain(prefix))
    kv.apply_batch(b.url, 1, _batch(["AllBlocksCleared"]))
    b.outstanding_requests = 1
    assert ca.pick([b, c], prefix, exact) is c


def test_request_exact_prompt_and_reported_cached_tokens():
    r = parse_request("/generate", {"input_ids": [1, 2, 3], "extra_key": "s", "lora_path": "ad"})
    assert r.exact == ExactPrompt([1, 2, 3], "s", "ad")
    assert parse_request("/generate", {"text": "hi"}).exact is None
    assert parse_request("/generate", {"input_ids": [1, 2], "routing_key": "k"}).exact is None
    assert parse_request("/v1/completions", {"model": "m", "prompt": [5, 6]}).exact == ExactPrompt([5, 6], "", "m")
    assert cached_tokens_of({"meta_info": {"cached_tokens": 8}}) == 8
    assert cached_tokens_of([{"usage": {"prompt_tokens_details": {"cached_tokens": 4}}}]) == 4
    assert cached_tokens_of({"text": "x"}) is None



def test_ties_go_to_the_worker_holding_fewest_tokens_by_its_events():
    """No worker holds the prompt (a tie below the threshold) at equal load: a worker with events counts the
    tokens its KV index holds, not its approximate tree; one without events its tree's estimate."""
    a, b, c = _worker("http://a:1"), _worker("http://b:1"), _worker("http://c:1")
    kv = KVIndex()
    for w in (a, b):
        kv.worker(w.url, f"tcp://{w.url[7:8]}:1", PAGE)
    ca = CacheAware(PrefixIndex(block_chars=8), kv=kv)
    ca.index.insert(b.url, ca.index.chain("x" * 80))  # b's tree: 10 blocks; a's: none
    kv.apply_batch(a.url, 0, _batch(_stored(block_hashes(list(range(40)), PAGE))))  # a holds 40 tokens
    kv.apply_batch(b.url, 0, _batch(_stored(block_hashes(list(range(100, 108)), PAGE))))  # b holds 8
    exact = ExactPrompt(list(range(500, 532)))
    assert ca.held(a) == 40 and ca.held(b) == 8
    assert ca.pick([a, b], "y" * 64, exact) is b  # the tree's size would pick a
    assert ca.held(c) == 0  # no events, empty tree
    assert ca.pick([a, b], "y" * 64, exact) is b  # routed there a moment ago: pending on b
    other = ExactPrompt(list(range(600, 632)))  # a prompt nobody holds or was sent
    assert ca.pick([a, b, c], "z" * 64, other) is c
    assert ca.held(c) == 64 // 4  # the picked prompt's 64 characters in its tree: ~16 tokens
    b.outstanding_requests = 1  # load first, then the tokens held
    assert ca.pick([a, b], "v" * 64, ExactPrompt(list(range(700, 732)))) is a


def _pair_with_events() -> tuple[Worker, Worker, KVIndex, CacheAware]:
    """Workers a and b, both publishing events into one index, and the prefill policy over it."""
    a, b = _worker("http://a:1"), _worker("http://b:1")
    kv = KVIndex()
    for w in (a, b):
        kv.worker(w.url, f"tcp://{w.url[7:8]}:1", PAGE)
    return a, b, kv, CacheAware(PrefixIndex(block_chars=8), kv=kv, predicts=True)


def test_with_events_everywhere_the_pick_weighs_what_is_cached_against_the_queue():
    """Every candidate publishes events: the pick is the least work before the first token, the worker's
    outstanding tokens plus the prompt tokens it would compute (overlap against load)."""
    a, b, kv, ca = _pair_with_events()
    ids = list(range(64))
    kv.apply_batch(a.url, 0, _batch(_stored(block_hashes(ids[:48], PAGE))))  # a holds 48 of the 64
    exact = ExactPrompt(ids)
    a.outstanding_tokens = 10  # 10 + 16 to compute < b's 0 + 64
    assert ca.pick([a, b], "p", exact) is a
    assert kv.workers[a.url].predicted_tokens == 48
    a.outstanding_tokens = 100  # 100 + 16 > 0 + 64: the idle worker computes it all sooner
    assert ca.pick([a, b], "p", exact) is b


def test_routed_blocks_count_until_the_worker_reports_or_they_expire():
    """A burst with one prefix: the first request's blocks are not reported yet when the second is routed, so
    the index counts them as pending where the first went; the worker's BlockStored replaces the guess, a
    BlockRemoved drops it, and an unconfirmed guess expires after PENDING_S."""
    from router.kv_index import PENDING_S

    a, b, kv, ca = _pair_with_events()
    ids = list(range(64))
    h = block_hashes(ids, PAGE)
    exact = ExactPrompt(ids)
    first = ca.pick([a, b], "p", exact)
    assert kv.longest_prefix(first.url, h) == (16, 0)  # pending: nothing reported yet
    first.outstanding_tokens, first.outstanding_requests = 32, 1
    assert ca.pick([a, b], "p", exact) is first  # 32 queued + 0 to compute beats 0 + 64 on the other
    assert kv.workers[first.url].predicted_tokens == 64
    kv.apply_batch(first.url, 0, _batch(_stored(h[:8])))  # reported: half of it
    assert len(kv.workers[first.url].pending) == 8 and kv.longest_prefix(first.url, h) == (16, 0)
    kv.apply_batch(first.url, 1, _batch(["BlockRemoved", h[8:10], GPU]))  # evicted before it was reported
    assert kv.longest_prefix(first.url, h) == (8, 0)
    w = kv.workers[first.url]
    w.expire(time.monotonic() + PENDING_S + 1)  # the rest was never confirmed
    assert not w.pending and kv.longest_prefix(first.url, h) == (8, 0)
    assert w.to_json()["pending_blocks"] == 0
    kv.record_routed("http://none:1", exact)  # a worker without events: nothing recorded
    assert "http://none:1" not in kv.workers
