"""The prefix cache on hybrid recurrent models (issue 48, item 4): state snapshots in the radix tree.

First the mechanics without a model (engine.kvcache.kv_manager over a tiny state pool): where prompt
chunks end, the snapshot budget and its LRU, the admission rule counting only the requests' slots,
and a finished request's snapshots going to the tree's nodes (a duplicate freed). Then served, on the
tiny Qwen3-Next and Nemotron-H models (tests/hybrid_models.py): a prompt sharing a finished one's
prefix restarts from the deepest snapshot at or below the match (cached_tokens says so) with exactly
the cache-off greedy tokens; a multi-turn conversation reuses past the previous turn's prompt (a
decode-time snapshot) and up to its prompt's last page; forks (n > 1) over a cached prefix; a small
pool evicts pages with their snapshots and a small snapshot budget drops the least recently used;
an abort storm and flush free everything; the in-process PD pair (the prefill's cache on, the
decode's off for these models) equals colocated.
"""

from __future__ import annotations

import pytest
import torch

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.engine import LLM
from engine.forward.model_runner import ModelRunner
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.memory import HostKVPool, KVPool
from engine.recurrent.state_pool import StatePart, StatePool, StateSpec
from engine.request import LogprobState, Req
from engine.request_groups import LogprobParams
from engine.sampling.params import SamplingParams
from engine.scheduling.planner import ExtendPlanner
from service import messages as m
from tests.hybrid_models import CONFIGS, VOCAB, write_hybrid
from tests.pd_harness import PDPair, collect, colocated_tokens, kv_manager

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
PS, EVERY = 16, 64  # page size, snapshot interval


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


# ---- mechanics, no model -----------------------------------------------------------------------

def _manager(request_slots: int = 4, snapshot_slots: int = 2, pages: int = 64) -> KVManager:
    pool = KVPool(num_pages=pages + 1, num_layers=1, page_size=PS, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                  device="cpu")
    host = HostKVPool(pages, tuple(pool.buffer.shape[1:]), torch.float32, pin=False)
    states = StatePool(StateSpec((StatePart("l.ssm", (3,), torch.float32),)), request_slots + snapshot_slots, "cpu")
    return KVManager(pool, host, prefix_cache=True, states=states, snapshot_slots=snapshot_slots,
                     snapshot_interval=EVERY)


def _req(rid: str, ids: list[int]) -> Req:
    return Req(rid=rid, token_ids=list(ids), sampling=GREEDY)


def _compute(kv: KVManager, r: Req, n: int) -> None:
    """What a forward of r's next n tokens leaves behind: kv_len advanced, its slot holding a marker of
    that length (so a snapshot's content says where it was taken), then the checkpoint."""
    kv.grow(r, n)
    r.kv.kv_len += n
    kv.states.buffer[r.kv.state_slot].view(torch.float32)[0] = r.kv.kv_len  # type: ignore[union-attr]
    kv.checkpoint(r)


def _marker(kv: KVManager, slot: int) -> float:
    return kv.states.buffer[slot].view(torch.float32)[0].item()  # type: ignore[union-attr]


def test_chunks_end_at_the_deepest_snapshot_point_inside_them():
    kv = _manager()
    r = _req("a", list(range(203)))  # prompt points: multiples of 64, and 192 (its last page boundary)
    assert kv.snapshot_cut(r, 50) == 50  # no point inside
    assert kv.snapshot_cut(r, 64) == 64  # ends on one
    assert kv.snapshot_cut(r, 150) == 128  # at most one cut: the deepest point
    r.kv.kv_len = 130
    assert kv.snapshot_cut(r, 73) == 62  # 192: a multiple and the prompt's last page boundary
    r.kv.kv_len = 192
    assert kv.snapshot_cut(r, 11) == 11
    p = _req("b", list(range(100)))
    assert kv.snapshot_cut(p, 100) == 96  # the prompt's last page boundary (deeper than 64)
    p.kv.kv_len = 70
    assert kv.snapshot_cut(p, 30) == 26
    off = KVManager(kv.pool, kv.host, prefix_cache=False, states=kv.states, snapshot_slots=2, snapshot_interval=EVERY)
    assert off.cache is None and off.snapshot_cut(r, 11) == 11 and not off.checkpoint(r)


def test_snapshot_budget_lru_and_admission_counts_only_request_slots():
    kv = _manager(request_slots=2, snapshot_slots=2)
    assert kv.free_slots == 2 and kv.states.num_free == 4  # requests get --max-state-slots, never the snapshots'
    a = _req("a", _ids(1, 203))
    _compute(kv, a, 64)
    _compute(kv, a, 64)
    _compute(kv, a, 64)  # a third point: the budget (2) is held by a itself, so none taken
    assert [n for n, _ in a.kv.snapshots] == [64, 128] and kv.snapshots_held == 2
    assert kv.free_slots == 1 and kv.slots_used == 1  # the snapshots do not count against requests
    _compute(kv, a, 11)
    kv.release(a)
    assert kv.cached_snapshots == 2 and kv.snapshots_held == 0 and kv.states.num_used == 2
    assert kv.free_slots == 2  # cached snapshots never stand in a request's way
    b = _req("b", a.token_ids[:150] + _ids(2, 60))  # shares 150 tokens: 9 pages match, the snapshot at 128
    assert kv.prefix_len(b) == 128 and kv.match(b) == 128
    assert b.kv.cached_tokens == 128 and b.kv.shared_pages == 8 and _marker(kv, b.kv.state_slot) == 128
    # 192: a new snapshot takes a cached one's slot: the least recently used, of two used together the deeper
    _compute(kv, b, 64)
    assert [n for n, _ in b.kv.snapshots] == [192] and kv.cached_snapshots == 1 and kv.cache.evicted_states == 1
    kv.release(b)
    assert kv.cached_snapshots == 2 and kv.states.num_used == 2
    c = _req("c", a.token_ids[:140] + _ids(3, 20))  # 8 pages match: the snapshot at 128 is gone, 64's is not
    assert kv.match(c) == 64 and _marker(kv, c.kv.state_slot) == 64
    kv.release(c)
    assert kv.flush() > 0 and kv.cached_snapshots == 0 and kv.all_free()


def test_duplicate_snapshots_are_freed_and_unmatch_gives_the_slot_back():
    kv = _manager(request_slots=3, snapshot_slots=4)
    ids = _ids(4, 140)
    a, b = _req("a", ids), _req("b", ids)  # the same prompt computed twice at once
    for r in (a, b):
        _compute(kv, r, 128)
        _compute(kv, r, 12)
    assert kv.snapshots_held == 2  # each at 128 (a multiple, and the prompt's last page boundary)
    kv.release(a)
    kv.release(b)  # b's snapshot lands on the node that holds a's: freed
    assert kv.cached_snapshots == 1 and kv.states.num_used == 1
    c = _req("c", ids)
    assert kv.match(c) == 128 and kv.states.num_used == 2
    kv.unmatch(c)
    assert c.kv.state_slot < 0 and kv.states.num_used == 1 and c.kv.kv_len == 0
    kv.flush()
    assert kv.all_free()


def test_a_chunk_cut_at_a_snapshot_point_does_not_end_the_batch():
    kv = _manager(request_slots=4, snapshot_slots=4)
    cfg = EngineConfig(page_size=PS, chunked_prefill_size=512, max_prefill_tokens=1024, prefix_cache=True)
    a, b = _req("a", _ids(5, 100)), _req("b", _ids(6, 40))
    items = ExtendPlanner(kv, cfg).plan([a, b])
    assert [(it.req.rid, it.num_tokens, it.completes_prompt) for it in items] == [("a", 96, False), ("b", 32, False)]
    assert len(a.kv.pages) == 7  # pages for the whole chunk: the rest (4 tokens) runs next step


# ---- served -------------------------------------------------------------------------------------

def _cfg(path: str, **kw: object) -> EngineConfig:
    base = dict(model=path, max_total_tokens=2048, host_kv_tokens=1024, page_size=PS, chunked_prefill_size=64,
                max_prefill_tokens=256, threads=1, prefix_cache=True, state_snapshot_interval=EVERY,
                max_running_requests=8)
    return EngineConfig(**(base | kw))


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(1)
    dst = tmp_path_factory.mktemp(request.param)
    write_hybrid(request.param, dst)
    return str(dst)


@pytest.fixture(scope="module")
def cached(family):  # noqa: ANN001, ANN201
    return LLM(_cfg(family))


@pytest.fixture(scope="module")
def uncached(family):  # noqa: ANN001, ANN201
    return LLM(_cfg(family, prefix_cache=False))


def _serve(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[Req]:
    """Each prompt to its end, one after the other (each sees the cache the previous ones left), with
    its output tokens' logprobs."""
    out = []
    for i, ids in enumerate(prompts):
        r = Req(rid=f"q{i}", token_ids=list(ids), sampling=params, logprobs=LogprobState(asked=LogprobParams(on=True)))
        llm.scheduler.add(r)
        while not r.finished:
            llm.scheduler.step()
            llm.scheduler.drain()
        assert r.error is None, r.error
        out.append(r)
    return out


def _same(got: list[Req], want: list[Req]) -> None:
    """The same greedy tokens, and logprobs equal to fp32 rounding (a restart from a wrong state can
    keep a tiny model's argmax but not its logprobs)."""
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for g, w in zip(got, want):
        diff = max(abs(a - b) for a, b in zip(g.logprobs.output, w.logprobs.output))
        assert diff < 1e-4, diff


def _check_books(kv: KVManager) -> None:
    """Every slot accounted for: requests' + held snapshots + the tree's, and the tree's count honest."""
    nodes = kv.cache._nodes()  # type: ignore[union-attr]
    assert sum(x.state >= 0 for x in nodes) == kv.cached_snapshots
    assert kv.snapshots_held + kv.cached_snapshots <= kv.snapshot_slots
    assert kv.states.num_used == kv.slots_used + kv.snapshots_held + kv.cached_snapshots  # type: ignore[union-attr]


def _drained(llm: LLM) -> None:
    kv = llm.scheduler.kv
    _check_books(kv)
    assert kv.slots_used == 0 and kv.snapshots_held == 0
    kv.flush()
    assert kv.all_free() and kv.states.num_used == 0  # type: ignore[union-attr]


def test_a_shared_prefix_restarts_from_the_deepest_snapshot(cached, uncached):
    base = _ids(11, 150)
    first, second = base + _ids(12, 13), base + _ids(13, 20)  # 163 and 170 tokens, 150 shared
    want = _serve(uncached, [first, second])
    hits = cached.scheduler.kv.hit_tokens
    got = _serve(cached, [first, second])
    _same(got, want)
    # the tree matches 9 pages (144 tokens); the deepest snapshot on them is at 128 (64, 128, then 160)
    assert got[0].kv.cached_tokens == 0 and got[1].kv.cached_tokens == 128
    stats = cached.scheduler.stats().prefix
    assert stats.hit_tokens - hits == 128 and stats.state_snapshots == cached.scheduler.kv.cached_snapshots >= 3
    _drained(cached)


def test_multi_turn_reuses_past_the_previous_turns_prompt(cached, uncached):
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    turn1 = _ids(21, 120)

    def talk(llm: LLM) -> list[Req]:
        turns, prompt = [], turn1
        for t in range(3):
            (r,) = _serve(llm, [prompt], params)
            turns.append(r)
            prompt = prompt + r.output_ids + _ids(22 + t, 30)
        return turns

    want = talk(uncached)
    got = talk(cached)
    _same(got, want)
    # turn 1 (120 tokens) decoded through 128, a multiple of 64: turn 2 (170 tokens) resumes past its prompt;
    # turn 2 computed 128..170 and decoded to 189: turn 3 resumes at its prompt's last page boundary, 160
    assert [r.kv.cached_tokens for r in got] == [0, 128, 160]
    assert got[1].kv.cached_tokens > len(turn1)
    _drained(cached)


def test_forks_over_a_cached_prefix(family):
    cfg = _cfg(family)
    base = _ids(31, 140)
    want = colocated_tokens(_cfg(family, prefix_cache=False), [base + [7, 8, 9]], GREEDY)["r0"]
    runner = ModelRunner(cfg)
    role = ColocatedRole(cfg, runner, kv_manager(runner, True))
    done: dict[str, m.TokenOut] = {}
    for rid, ids, n in (("a", base + [4, 5], 1), ("b", base + [7, 8, 9], 3)):
        tokens: dict[str, list[int]] = {}
        collect(role.add(m.GenerateReq(rid=rid, input_ids=ids, sampling=GREEDY, n=n)), tokens, done)
        while sum(k.startswith(rid) for k in done) < n:
            collect(role.step(), tokens, done)
    assert tokens == {"b": want, "b#1": want, "b#2": want}
    assert done["b"].cached_tokens == 128 and done["b#2"].cached_tokens == 128
    _check_books(role.kv)
    role.kv.flush()
    assert role.kv.all_free()


def test_pages_evicted_take_their_snapshots_and_a_full_budget_drops_the_lru(family, uncached):
    prompts = [_ids(40 + i, 150) for i in range(6)]
    want = _serve(uncached, prompts + prompts[:1])
    small = LLM(_cfg(family, max_total_tokens=384, state_cache_slots=16))  # 24 pages: two prompts' worth
    got = _serve(small, prompts + prompts[:1])
    kv = small.scheduler.kv
    _same(got, want)
    assert kv.cache.evicted_pages > 0 and kv.cache.evicted_states > 0  # type: ignore[union-attr]
    assert kv.cached_snapshots < kv.snapshot_slots  # dropped with their pages, never for the budget
    assert got[-1].kv.cached_tokens == 0  # prompt 0 was evicted long ago
    _drained(small)

    few = LLM(_cfg(family, state_cache_slots=2))  # a big pool, two snapshot slots
    got = _serve(few, prompts[:3] + prompts[2:3] + prompts[:1])
    kv = few.scheduler.kv
    _same(got, [want[0], want[1], want[2], want[2], want[0]])
    assert kv.cache.evicted_pages == 0 and kv.cache.evicted_states > 0  # type: ignore[union-attr]
    assert got[3].kv.cached_tokens == 128 and got[4].kv.cached_tokens == 0  # the newest kept, the oldest dropped
    _drained(few)


def test_the_host_tier_keeps_pages_whose_snapshots_stay_on_the_device(family, uncached):
    """--hicache-host-tokens on a hybrid model: a device pool of two prompts' pages evicts the older prompts'
    pages to the host; their snapshots stay in their device slots with their nodes. The first prompt again
    loads its pages back from the host up to its deepest snapshot (144 tokens) and restarts from that state:
    the same tokens and logprobs as without a cache, host hits counted, every slot accounted for."""
    prompts = [_ids(40 + i, 150) for i in range(6)]
    want = _serve(uncached, prompts + prompts[:1])
    tiered = LLM(_cfg(family, max_total_tokens=384, state_cache_slots=32, hicache_host_tokens=4096))
    got = _serve(tiered, prompts + prompts[:1])
    kv = tiered.scheduler.kv
    _same(got, want)
    assert kv.cache.evictions["device"] > 0 and kv.cache.evicted_states == 0  # type: ignore[union-attr]
    # its snapshots are at 64, 128 and its prompt's last page boundary, 144: all nine pages come back
    assert got[-1].kv.cached_tokens == 144 and kv.cache.hits["host"] == 144  # type: ignore[union-attr]
    _drained(tiered)


def test_an_abort_storm_with_the_cache_frees_everything(cached):
    sched = cached.scheduler
    base = _ids(60, 130)
    _serve(cached, [base + [3]])
    reqs = [Req(rid=f"a{i}", token_ids=base + _ids(61 + i, 20 + 30 * i), sampling=GREEDY) for i in range(6)]
    for r in reqs:
        sched.add(r)
    for _ in range(3):
        sched.step()
        sched.drain()
    assert sched.kv.snapshots_held > 0 and any(r.kv.cached_tokens == 128 for r in reqs)
    sched.abort(everything=True)
    sched.step()
    sched.drain()
    _drained(cached)


def test_pd_in_process_with_the_prefill_cache_equals_colocated(family, uncached):
    cfg = _cfg(family)
    base = _ids(70, 140)
    prompts = [base + _ids(71, 9), base + _ids(72, 30)]
    want = _serve(uncached, prompts)
    pair = PDPair(cfg, heartbeat_s=5.0, decode_cache=True)  # the decode keeps no cache for a hybrid model
    try:
        assert pair.d_kv.cache is None and pair.d_kv.states.capacity == cfg.max_running_requests
        assert pair.p_kv.cache is not None and pair.p_kv.snapshot_slots == cfg.max_running_requests
        runs = []
        for i, ids in enumerate(prompts):  # one after the other: the second hits the prefill's cache
            seen: list[m.TokenOut] = []
            got, d_done, p_done = pair.run([ids], GREEDY, fields={"return_logprob": True}, seen=seen,
                                           room_base=100 * (i + 1))
            assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
            runs.append((got["r0"], [x for o in seen for x in o.new_logprobs], p_done["r0"], d_done["r0"]))
        assert [r[0] for r in runs] == [w.output_ids for w in want]
        for (_, lps, _, _), w in zip(runs, want):
            assert max(abs(a - b) for a, b in zip(lps, w.logprobs.output, strict=True)) < 1e-4
        assert [r[2].cached_tokens for r in runs] == [0, 128] and runs[1][3].cached_tokens == 128
        assert pair.d_kv.all_free()
        _check_books(pair.p_kv)
        pair.p_kv.flush()
        assert pair.p_kv.all_free()
    finally:
        pair.close()


def test_flags_size_the_pool_and_what_is_refused(family):
    runner = ModelRunner(_cfg(family, state_cache_slots=3))
    kv = kv_manager(runner, True)
    assert runner.states.capacity == 8 + 3 and kv.snapshot_slots == 3 and kv.request_slots == 8
    assert runner.server_info()["state_snapshot_slots"] == 3
    off = ModelRunner(_cfg(family, state_cache_slots=0))  # no snapshots: no prefix cache for a hybrid model
    assert off.states.capacity == 8 and kv_manager(off, True).cache is None
    assert ModelRunner(_cfg(family, prefix_cache=False)).states.capacity == 8
    with pytest.raises(ValueError, match="has recurrent layers; .*--state-snapshot-interval \\(40\\).* multiple of "
                                         "--page-size \\(16\\)"):
        ModelRunner(_cfg(family, state_snapshot_interval=40))
    ModelRunner(_cfg(family, state_snapshot_interval=40, state_cache_slots=0))  # no snapshots: not checked
