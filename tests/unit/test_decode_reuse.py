"""Decode-side prefix reuse (issue 14 part 3): a PD decode keeps finished requests' KV in its own
prefix cache, names the cached prefix (tokens + hash) in its TransferInfo, and the prefill sends
only the pages after it. In-process prefill + decode roles (tests/pd_harness.py) over the tiny
random-weight model and the fake data backend (bytes copied in-process): greedy tokens equal the
run without any cache, fewer bytes move, a refused prefix falls back to the whole prompt, aborts
and oversubscription leave no lock and no page behind."""

from __future__ import annotations

import pytest

import transfer.decode_side
from engine.config import EngineConfig
from engine.sampling.params import SamplingParams
from service import messages as m
from service.worker import flush_cache
from tests.pd_harness import PDPair, collect, generate_req
from tests.tiny_model import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def _cfg(model_dir: str, cache: bool, **kw: object) -> EngineConfig:
    base = dict(model=model_dir, max_total_tokens=2048, host_kv_tokens=1024, page_size=4,
                chunked_prefill_size=16, max_prefill_tokens=64, prefix_cache=cache)
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def _chat(pair: PDPair, turns: int, sampling: SamplingParams = GREEDY, n: int = 3,
          system: int = 10) -> list[list[list[int]]]:
    """n multi-turn conversations over the pair: turn t's prompt is turn t-1's prompt + its reply +
    new tokens (a shared `system`-token system prompt). Returns each turn's tokens, by conversation."""
    history = [list(range(100, 100 + system)) for _ in range(n)]
    out = []
    for t in range(turns):
        prompts = [h + [(13 * c + 5 * t + i) % 250 for i in range(9 + 3 * t + c)] for c, h in enumerate(history)]
        tokens, d_done, p_done = pair.run(prompts, sampling, room_base=1000 * (t + 1))
        assert all(o.error is None for o in [*d_done.values(), *p_done.values()])
        got = [tokens[f"r{c}"] for c in range(n)]
        history = [p + g for p, g in zip(prompts, got)]
        out.append(got)
    return out


def _drained(pair: PDPair) -> None:
    """No lock left, and after /flush_cache's worker answer every pool is back to 0."""
    for kv in (pair.p_kv, pair.d_kv):
        assert kv.used_tokens == 0
        if kv.cache is not None:
            assert kv.cache.evictable_pages == kv.cache.cached_pages  # nothing locked
    assert flush_cache(pair.decode, 1).ok and flush_cache(pair.prefill, 2).ok
    assert pair.p_kv.all_free() and pair.d_kv.all_free()
    assert pair.d_mgr.active_rooms() == 0 and pair.p_mgr.active_rooms() == 0


def test_multi_turn_pd_greedy_identical_and_only_new_pages_move(model_dir: str) -> None:
    runs = {}
    for cache in (False, True):
        pair = PDPair(_cfg(model_dir, cache), decode_cache=cache)
        try:
            runs[cache] = _chat(pair, 3)
            d, p = pair.decode.stats(), pair.prefill.stats()
            assert d.transfer.bytes == p.transfer.bytes > 0  # both count what moved
            reused = d.counters.kv_pages_reused_on_decode
            if cache:
                assert reused > 0 and d.transfer.reused_bytes == reused * pair.d_kv.pool.page_bytes
                assert d.prefix.hit_tokens == reused * pair.d_kv.page_size
                assert d.counters.kv_prefix_refused_by_prefill == 0
            else:
                assert reused == 0 and pair.d_kv.cache is None
            runs[(cache, "bytes")] = d.transfer.bytes
            _drained(pair)
        finally:
            pair.close()
    assert runs[True] == runs[False]
    assert runs[(True, "bytes")] < 0.6 * runs[(False, "bytes")]


def test_refused_prefix_falls_back_to_the_whole_prompt(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode names a prefix whose hash the prefill does not share: the prefill refuses the
    TransferInfo, the decode asks again for every page, and the tokens are still right."""
    ref = PDPair(_cfg(model_dir, False))
    try:
        want = _chat(ref, 2)
    finally:
        ref.close()
    monkeypatch.setattr(transfer.decode_side, "prefix_hash", lambda ids: "0" * 32)
    pair = PDPair(_cfg(model_dir, True), decode_cache=True)
    try:
        assert _chat(pair, 2) == want
        d, p = pair.decode.stats(), pair.prefill.stats()
        assert d.counters.kv_prefix_refused_by_prefill == 3 == p.link.prefix_refusals
        assert d.counters.kv_pages_reused_on_decode == 0
        assert d.prefix.hit_tokens == 0  # the refused matches were given back
        _drained(pair)
    finally:
        pair.close()


def test_abort_of_a_decode_cache_hit_releases_its_locks(model_dir: str) -> None:
    pair = PDPair(_cfg(model_dir, True), decode_cache=True)
    try:
        ids = list(range(1, 30))
        pair.run([ids], GREEDY)
        cache = pair.d_kv.cache
        assert cache is not None and cache.cached_pages > 0
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.p_mgr.bootstrap_port, "bootstrap_room": 7}
        req = generate_req("b", ids + [7, 8, 9], GREEDY, **boot)
        pair.prefill.add(req)
        pair.decode.add(req)
        pair.decode.step()  # admitted: the cached prefix is matched and locked, the room opened
        held = [r for r, _, _ in pair.decode.transfer.values()]
        assert len(held) == 1 and held[0].kv.shared_pages == 7 and cache.evictable_pages < cache.cached_pages
        pair.decode.abort(m.AbortReq(rid="b"))
        pair.prefill.abort(m.AbortReq(rid="b"))
        done: dict[str, m.TokenOut] = {}
        while "b" not in done:
            collect(pair.decode.step() + pair.prefill.step(), {}, done)
        assert done["b"].finish_reason is not None
        assert pair.decode.busy() == 0 and pair.prefill.busy() == 0
        assert cache.evictable_pages == cache.cached_pages  # the transfer-phase abort unlocked

        # the same after the KV arrived: a running request over the decode's cached prefix
        long = SamplingParams(temperature=0.0, max_new_tokens=500, ignore_eos=True)
        req = generate_req("c", ids + [4, 5], long, **{**boot, "bootstrap_room": 8})
        pair.prefill.add(req)
        pair.decode.add(req)
        tokens: dict[str, list[int]] = {}
        for _ in range(5000):  # until it has decoded a few tokens (bounded: a hang fails, not waits)
            if len(tokens.get("c", [])) >= 3:
                break
            collect(pair.decode.step() + pair.prefill.step(), tokens, done)
            pair.p_mgr.idle_wait(0.002)
        running = pair.decode.sched.running
        assert [r.rid for r in running] == ["c"] and running[0].kv.shared_pages == 7
        assert pair.decode.stats().counters.kv_pages_reused_on_decode == 7
        pair.decode.abort(m.AbortReq(rid="c"))
        collect(pair.decode.step(), tokens, done)
        assert done["c"].finish_reason is not None and pair.decode.busy() == 0
        _drained(pair)
    finally:
        pair.close()


def test_oversubscribed_decode_evicts_and_retracts_with_unchanged_outputs(model_dir: str) -> None:
    """A decode pool of 96 tokens for 4 conversations x 3 turns (a turn holds up to ~90 tokens each:
    ~4x the pool): its cache is evicted, running requests are retracted to the host and
    reloaded, outputs equal the run without caches, and every pool drains."""
    long = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    ref = PDPair(_cfg(model_dir, False))
    try:
        want = _chat(ref, 3, long, n=4)
    finally:
        ref.close()
    small = _cfg(model_dir, True, max_total_tokens=96, new_token_ratio=0.0)
    pair = PDPair(_cfg(model_dir, True), decode_cfg=small, decode_cache=True)
    try:
        assert _chat(pair, 3, long, n=4) == want
        kv = pair.d_kv
        assert kv.retractions > 0 and kv.reloads == kv.retractions
        assert kv.cache is not None and kv.cache.evicted_pages > 0
        assert pair.decode.stats().counters.kv_pages_reused_on_decode > 0
        _drained(pair)
    finally:
        pair.close()


def test_local_prefill_threshold_counts_only_uncached_tokens(model_dir: str) -> None:
    """Conditional disaggregation over the decode's cache: a conversation's first turn (long) goes
    PD, its later turns (a long prompt, but only a few tokens the decode's cache lacks) are
    prefilled on the decode, with the tokens of the run without any cache."""
    runs = {}
    for cache in (False, True):
        # threshold 48 also bounds the local queue: both conversations' next turns (<= 20 new tokens each)
        pair = PDPair(_cfg(model_dir, cache), decode_cache=cache, local_threshold=48)
        try:
            # turn 1: ~90 prompt tokens; later turns add <= 20 the decode's cache lacks
            runs[cache] = _chat(pair, 3, n=2, system=80)
            counters = pair.decode.stats().counters
            runs[(cache, "local")] = counters.prefills_local
            _drained(pair)
        finally:
            pair.close()
    assert runs[True] == runs[False]
    assert runs[(False, "local")] == 0  # every prompt is longer than 48 tokens
    assert runs[(True, "local")] == 4  # turns 2 and 3 of both conversations
