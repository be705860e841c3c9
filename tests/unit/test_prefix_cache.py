"""Prefix cache (issue 14): the radix tree alone, then the engine over a tiny random-weight model:
a cached prefix gives the same logits and greedy tokens as a from-scratch run, locks and pools stay
honest under eviction, retraction and abort, and the PD prefill delivers the whole prompt."""

from __future__ import annotations

import pytest
import torch

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.forward.forward_batch import LOGITS_ALL, Segment, forward_segments
from engine.forward.model_runner import ModelRunner
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.memory import PageAllocator
from engine.kvcache.radix_cache import RadixCache
from engine.request import Req
from engine.request_groups import ReqOptions
from engine.sampling.params import SamplingParams
from engine.scheduling.policy import order_by_policy
from engine.scheduling.scheduler import Scheduler
from service import messages as m
from service.worker import flush_cache
from tests.pd_harness import PDPair, collect, kv_manager
from tests.tiny_model import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


# ---- the tree alone ---------------------------------------------------------------------------
def test_radix_match_insert_lock_evict() -> None:
    alloc = PageAllocator(20, reserved=1)
    tree = RadixCache(4, alloc.free)
    a = alloc.allocate(3)
    node, dup = tree.insert(list(range(12)) + [99], a, 0)  # 3 full pages; the partial 13th token is not cached
    assert dup == [] and tree.cached_pages == 3 and tree.evictable_pages == 3
    hit = tree.match(list(range(8)) + [50, 51, 52, 53, 54])
    assert hit.pages == a[:2]
    assert tree.match(list(range(12)), max_tokens=11).pages == a[:2]  # never past max_tokens
    tree.lock(hit.node)
    assert tree.evictable_pages == 1
    b = alloc.allocate(3)  # the same ids computed again elsewhere: duplicates come back to be freed
    _, dup = tree.insert(list(range(12)), b, 0)
    assert dup == b and tree.cached_pages == 3
    alloc.free(dup)
    assert tree.evict(10) == 1  # only the unlocked leaf goes; its locked parents stay
    assert tree.match(list(range(12))).pages == a[:2]
    tree.unlock(hit.node)
    assert tree.evictable_pages == 2 and tree.flush() == 2 and alloc.all_free()
    assert tree.evicted_pages == 3


def test_radix_namespaces_never_share_pages() -> None:
    """A prefix cached under one namespace (cache salt, LoRA adapter) is invisible to another and to
    the default; each namespace evicts and flushes like the default tree."""
    alloc = PageAllocator(20, reserved=1)
    tree = RadixCache(4, alloc.free)
    ids = list(range(9))
    salted = alloc.allocate(2)
    tree.insert(ids, salted, 0, namespace="tenant-a")
    assert tree.match_len(ids) == 0 and tree.match_len(ids, namespace="tenant-b") == 0
    assert tree.match(ids, namespace="tenant-a").pages == salted
    plain = alloc.allocate(2)
    _, dup = tree.insert(ids, plain, 0)  # the same ids unsalted: a page of its own, not a duplicate
    assert dup == [] and tree.cached_pages == 4 and tree.match(ids).pages == plain
    assert Req("r", ids, GREEDY, options=ReqOptions(extra_key="a")).cache_namespace != \
        Req("r", ids, GREEDY, options=ReqOptions(lora="a")).cache_namespace
    assert Req("r", ids, GREEDY).cache_namespace == ""
    assert tree.flush() == 4 and alloc.all_free()


def test_radix_evicts_least_recently_used_first() -> None:
    alloc = PageAllocator(10, reserved=1)
    tree = RadixCache(2, alloc.free)
    old, new = alloc.allocate(1), alloc.allocate(1)
    tree.insert([1, 2], old, 0)
    tree.insert([3, 4], new, 0)
    tree.match([1, 2, 9])  # touch: [3, 4] is now the least recently used
    tree.evict(1)
    assert tree.match_len([1, 2]) == 2 and tree.match_len([3, 4]) == 0


def test_lpm_orders_by_cached_prefix_with_aging() -> None:
    reqs = [Req(rid=r, token_ids=[1] * 8, sampling=GREEDY, created=t) for r, t in
            (("none", 1.0), ("long", 2.0), ("short", 3.0), ("old", 0.0))]
    hits = {"none": 0, "long": 64, "short": 16, "old": 0}
    order = order_by_policy(reqs, "lpm", 5.0, now=4.0, prefix_len=lambda r: hits[r.rid])
    assert [r.rid for r in order] == ["long", "short", "old", "none"]
    order = order_by_policy(reqs, "lpm", 5.0, now=5.5, prefix_len=lambda r: hits[r.rid])
    assert [r.rid for r in order][0] == "old"  # waited past the aging bound: first


# ---- the engine -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def _cfg(model_dir: str, cache: bool, **kw: object) -> EngineConfig:
    base = dict(model=model_dir, max_total_tokens=2048, host_kv_tokens=1024, page_size=4,
                chunked_prefill_size=16, max_prefill_tokens=64, prefix_cache=cache)
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_suffix_logits_over_cached_prefix_match_from_scratch(model_dir: str) -> None:
    runner = ModelRunner(_cfg(model_dir, True))
    kv = kv_manager(runner, True)
    prefix = [(7 * i + 3) % 250 for i in range(37)]
    first = Req(rid="a", token_ids=prefix + [1, 2], sampling=GREEDY)
    kv.grow(first, len(first.token_ids))
    forward_segments(runner, [Segment(first.kv.pages, 0, first.token_ids, LOGITS_ALL)])
    first.kv.kv_len = len(first.token_ids)
    kv.release(first)  # 39 tokens: 9 full pages cached
    ids = prefix + [(11 * i) % 250 for i in range(21)]
    req = Req(rid="b", token_ids=ids, sampling=GREEDY)
    assert kv.match(req) == 36 and req.kv.cached_tokens == 36
    kv.grow(req, len(ids) - req.kv.kv_len)
    cached = forward_segments(runner, [Segment(req.kv.pages, req.kv.kv_len, ids[req.kv.kv_len :], LOGITS_ALL)])
    cached = cached.logits[0]
    fresh = kv.allocate(15)
    scratch = forward_segments(runner, [Segment(fresh, 0, ids, LOGITS_ALL)]).logits[0]
    assert cached is not None and scratch is not None
    assert torch.allclose(cached, scratch[36:], atol=1e-3, rtol=0)
    kv.pool.allocator.free(fresh)
    req.kv.kv_len = len(ids)
    kv.release(req)
    kv.flush()
    assert kv.all_free()


def _serve(role: ColocatedRole, prompts: dict[str, list[int]], sampling: SamplingParams = GREEDY,
           ) -> tuple[dict[str, list[int]], dict[str, m.TokenOut]]:
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    for rid, ids in prompts.items():
        collect(role.add(m.GenerateReq(rid=rid, input_ids=ids, sampling=sampling)), tokens, done)
    for _ in range(2000):
        if len(done) == len(prompts):
            break
        collect(role.step(), tokens, done)
    assert len(done) == len(prompts) and all(o.error is None for o in done.values())
    return tokens, done


def _conversations(turns: int, n: int = 3) -> list[list[list[int]]]:
    """Per turn, the new user tokens of each of n conversations (a shared 10-token system prompt)."""
    return [[[(13 * c + 5 * t + i) % 250 for i in range(9 + 3 * t + c)] for c in range(n)] for t in range(turns)]


def _chat(role: ColocatedRole, turns: int, sampling: SamplingParams = GREEDY) -> tuple[list[dict], list[dict]]:
    """Multi-turn: each turn's prompt is the last prompt + its reply + new tokens. Tokens and outs per turn."""
    system = list(range(100, 110))
    history = {f"c{c}": list(system) for c in range(3)}
    toks, outs = [], []
    for t, news in enumerate(_conversations(turns)):
        prompts = {f"{cid}t{t}": history[cid] + new for cid, new in zip(history, news)}
        tokens, done = _serve(role, prompts, sampling)
        for cid in history:
            history[cid] = prompts[f"{cid}t{t}"] + tokens[f"{cid}t{t}"]
        toks.append(tokens)
        outs.append(done)
    return toks, outs


def test_multi_turn_greedy_identical_with_cache_on_and_off(model_dir: str) -> None:
    results = {}
    for cache in (False, True):
        cfg = _cfg(model_dir, cache)
        runner = ModelRunner(cfg)
        kv = kv_manager(runner, cache)
        role = ColocatedRole(cfg, runner, kv)
        results[cache] = _chat(role, 3)
        if cache:
            hits = [sum(o.cached_tokens for o in outs.values()) for outs in results[cache][1]]
            assert hits[1] > 0 and hits[2] > hits[1]  # later turns reuse their history
            assert kv.hit_tokens == sum(hits)
            assert role.stats().kv.used_tokens == 0 and role.stats().prefix.cached_tokens > 0
            kv.flush()
        assert kv.all_free()
    assert results[True][0] == results[False][0]


@pytest.mark.slow
def test_oversubscribed_pool_evicts_and_retracts_with_unchanged_outputs(model_dir: str) -> None:
    """A pool of 96 tokens for 3 conversations x 3 turns (up to 88 tokens each, ~3x the pool): the
    cache is evicted, running requests are retracted to the host, outputs equal a big pool's."""
    long = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    big_cfg = _cfg(model_dir, False)
    big = _chat(ColocatedRole(big_cfg, ModelRunner(big_cfg), kv_manager(ModelRunner(big_cfg))), 3, long)[0]
    cfg = _cfg(model_dir, True, max_total_tokens=96, new_token_ratio=0.0, schedule_policy="lpm")
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, True)
    role = ColocatedRole(cfg, runner, kv)
    small = _chat(role, 3, long)[0]
    assert small == big
    assert kv.retractions > 0 and kv.reloads == kv.retractions
    assert kv.cache is not None and kv.cache.evicted_pages > 0 and kv.hit_tokens > 0
    assert kv.cache.evictable_pages == kv.cache.cached_pages  # no lock left behind
    kv.flush()
    assert kv.all_free() and kv.used_tokens == 0


def test_abort_of_a_cache_hit_releases_its_locks(model_dir: str) -> None:
    cfg = _cfg(model_dir, True)
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, True)
    sched = Scheduler(runner, cfg, kv)
    ids = list(range(1, 30))
    first = Req(rid="a", token_ids=ids, sampling=GREEDY)
    sched.add(first)
    while not first.finished:
        sched.step()
    second = Req(rid="b", token_ids=ids + [7, 8, 9], sampling=SamplingParams(temperature=0.0, max_new_tokens=50))
    sched.add(second)
    sched.step()
    assert second.kv.cached_tokens == 28 and second.kv.prefix_node is not None
    assert kv.cache is not None and kv.cache.evictable_pages < kv.cache.cached_pages  # its path is locked
    assert sched.abort("b") == 1
    assert kv.cache.evictable_pages == kv.cache.cached_pages and kv.used_tokens == 0
    kv.flush()
    assert kv.all_free()


def test_pd_prefill_cache_sends_the_whole_prompt(model_dir: str) -> None:
    """The prefill reuses its cache; the decode still gets every page of the prompt: tokens equal
    the uncached colocated role's, cached_tokens reaches the decode's report, pools drain."""
    cfg = _cfg(model_dir, True)
    base = list(range(60, 101))
    rounds = [[base + [1, 2, 3], list(range(5, 30))], [base + [4, 5], list(range(5, 30)) + [9]]]
    pair = PDPair(cfg)
    try:
        for i, prompts in enumerate(rounds):
            ref_cfg = _cfg(model_dir, False)
            want, _ = _serve(ColocatedRole(ref_cfg, ModelRunner(ref_cfg), kv_manager(ModelRunner(ref_cfg))),
                             {f"r{j}": p for j, p in enumerate(prompts)})
            tokens, d_done, p_done = pair.run(prompts, GREEDY)
            assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
            assert tokens == want
            cached = [d_done[f"r{j}"].cached_tokens for j in range(len(prompts))]
            assert cached == ([0, 0] if i == 0 else [40, 24])
        assert pair.decode.stats().transfer.bytes == pair.prefill.stats().transfer.bytes
        assert pair.p_kv.used_tokens == 0 and pair.d_kv.all_free()
        assert pair.p_kv.flush() > 0 and pair.p_kv.all_free()
    finally:
        pair.close()


def test_windowed_model_runs_without_the_cache(tmp_path) -> None:  # noqa: ANN001
    runner = ModelRunner(_cfg(str(make_tiny_model(tmp_path, model_type="mistral", sliding_window=16)), True))
    kv = KVManager(runner.pool, runner.host_pool, runner.model_cfg.max_window, prefix_cache=True)
    assert kv.window == 16 and kv.cache is None


def test_flush_cache_is_refused_while_a_request_runs(model_dir: str) -> None:
    """The worker's answer to POST /flush_cache: not ok (the frontend's 409) while the role holds a
    request; once idle, the cache is emptied and every page is free."""
    cfg = _cfg(model_dir, True)
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, True)
    role = ColocatedRole(cfg, runner, kv)
    _serve(role, {"a": list(range(1, 40))})
    role.add(m.GenerateReq(rid="b", input_ids=list(range(1, 45)), sampling=GREEDY))
    role.step()
    busy = flush_cache(role, 7)
    assert (busy.token, busy.ok, busy.freed_tokens) == (7, False, 0) and "in flight" in busy.message
    while role.has_work():
        role.step()
    assert kv.cache is not None
    cached = kv.cache.cached_pages * kv.page_size
    done = flush_cache(role, 8)
    assert done.ok and done.freed_tokens == cached > 0 and kv.all_free()
