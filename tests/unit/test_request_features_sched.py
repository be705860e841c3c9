"""Issue 40 (priority, sessions, cache salt, routing key), the parts below HTTP: priority order and
preemption in the scheduler over a tiny random-weight model (outputs unchanged, low priority still
finishes), session pins in the prefix cache, the frontend's session store, the request options'
parse (400 naming the field) and the router's routing_key / session refusal."""

from __future__ import annotations

import pytest

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.forward.model_runner import ModelRunner
from engine.request import FinishReason, Req
from engine.request_groups import ReqOptions
from engine.sampling.params import SamplingParams
from engine.scheduling import priority
from engine.scheduling.policy import first_new, waiting_order
from engine.scheduling.scheduler import Scheduler
from engine.scheduling.sessions import SessionPins
from router.config import WorkerSpec
from router.policies import CacheAware
from router.prefix_index import PrefixIndex
from router.protocol import BadRequest, parse_request
from router.registry import Worker
from service import messages as m
from service.protocol import Limits, RequestError, parse_completion, parse_generate
from service.sessions import SessionStore
from tests.pd_harness import PDPair, collect, generate_req, kv_manager
from tests.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def _cfg(model_dir: str, **kw: object) -> EngineConfig:
    base = dict(model=model_dir, max_total_tokens=64, host_kv_tokens=1024, page_size=4, chunked_prefill_size=32,
                max_prefill_tokens=64, new_token_ratio=0.0)
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def _req(rid: str, n: int, new: int, prio: int = 0, seed: int = 1) -> Req:
    ids = [(seed * 31 + 7 * i) % 250 + 1 for i in range(n)]
    return Req(rid=rid, token_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True),
               options=ReqOptions(priority=prio))


# ---- order ----------------------------------------------------------------------------------------
def test_priority_order_urgency_flag_and_aging() -> None:
    cfg = EngineConfig(enable_priority_scheduling=True, priority_aging_s=10.0)
    a, b, c = _req("a", 4, 1, prio=1), _req("b", 4, 1, prio=5), _req("c", 4, 1, prio=1)
    a.created = b.created = c.created = 100.0
    assert [r.rid for r in waiting_order([a, b, c], cfg, now=101.0)] == ["b", "a", "c"]  # ties keep the order
    low_first = EngineConfig(enable_priority_scheduling=True, schedule_low_priority_values_first=True)
    assert [r.rid for r in waiting_order([b, a, c], low_first, now=101.0)] == ["a", "c", "b"]
    a.created = 80.0  # waited past the aging bound: ahead of every priority
    assert [r.rid for r in waiting_order([b, c, a], cfg, now=101.0)][0] == "a"
    with pytest.raises(ValueError, match="--priority-max-preemptions"):
        EngineConfig(priority_max_preemptions=-1)


# ---- preemption -------------------------------------------------------------------------------------
def _run(model_dir: str, prio: bool) -> tuple[dict[str, list[int]], int, int]:
    """Two long low-priority requests fill a 64-token pool; an urgent one arrives. Returns the outputs,
    the steps the urgent one waited for its first token and the retractions."""
    cfg = _cfg(model_dir, enable_priority_scheduling=prio)
    runner = ModelRunner(cfg)
    kv = kv_manager(runner)
    sched = Scheduler(runner, cfg, kv)
    lows = [_req("low0", 16, 14, prio=0, seed=1), _req("low1", 16, 14, prio=0, seed=2)]
    for r in lows:
        sched.add(r)
    for _ in range(8):  # both run, their KV grows toward the pool's size
        sched.step()
    assert all(r.num_output_tokens > 0 and not r.finished for r in lows)
    high = _req("high", 20, 4, prio=10, seed=3)  # 6 pages; 4 are free
    sched.add(high)
    waited = 0
    while not high.num_output_tokens:
        sched.step()
        waited += 1
    while sched.has_work():
        sched.step()
        sched.drain()
    assert all(r.finished and r.error is None for r in [*lows, high])
    assert kv.all_free()
    return {r.rid: r.output_ids for r in [*lows, high]}, waited, kv.retractions


@pytest.mark.slow
def test_priority_preempts_low_requests_with_outputs_unchanged(model_dir: str) -> None:
    plain, waited_plain, _ = _run(model_dir, prio=False)
    urgent, waited_urgent, retracted = _run(model_dir, prio=True)
    assert retracted >= 1  # the urgent arrival preempted a running low-priority request
    assert waited_urgent < waited_plain  # its first token came sooner
    assert urgent == plain  # every output (preempted ones too) is the same greedy text


def test_preemption_is_bounded_per_request(model_dir: str) -> None:
    """A request preempted priority_max_preemptions times is never a victim again."""
    cfg = _cfg(model_dir, enable_priority_scheduling=True, priority_max_preemptions=0)
    runner = ModelRunner(cfg)
    sched = Scheduler(runner, cfg, kv_manager(runner))
    lows = [_req("low0", 16, 14, seed=1), _req("low1", 16, 14, seed=2)]
    for r in lows:
        sched.add(r)
    for _ in range(8):
        sched.step()
    high = _req("high", 20, 4, prio=10, seed=3)
    sched.add(high)
    assert first_new(sched.waiting) is high and not sched.admits_first_chunk(high)  # it would preempt
    assert sched.preempt_for(high, lambda: sched.admits_first_chunk(high), now=lows[0].created) == 0
    sched.abort(everything=True)


def test_waiting_order_policy_then_priority_and_retracted_first() -> None:
    """One order for every scheduler: the schedule policy within a priority; a retracted request
    blocks what ranks behind it (first_new), not a more urgent arrival."""
    sjf = EngineConfig(enable_priority_scheduling=True, schedule_policy="sjf", schedule_aging_s=50.0)
    long_hi, short_hi, short_lo = _req("long_hi", 40, 1, prio=5), _req("short_hi", 8, 1, prio=5), _req("lo", 4, 1)
    for r in (long_hi, short_hi, short_lo):
        r.created = 100.0
    assert [r.rid for r in waiting_order([short_lo, long_hi, short_hi], sjf, now=101.0)] == \
        ["short_hi", "long_hi", "lo"]
    retracted = _req("retracted", 8, 4, prio=1)
    retracted.created, retracted.kv.host_pages = 99.0, [1]  # its KV is in the host pool
    cfg = EngineConfig(enable_priority_scheduling=True)
    assert first_new(waiting_order([retracted, short_lo, short_hi], cfg, now=101.0)) is short_hi
    assert first_new(waiting_order([retracted, short_lo], cfg, now=101.0)) is None  # it reloads first
    assert first_new(waiting_order([retracted, short_hi], EngineConfig(), now=101.0)) is None  # no priority


def test_preempt_is_handed_what_it_reads() -> None:
    """priority.preempt needs no scheduler: the running requests, the candidate, the admission rule
    and a retraction that may refuse (host pool full): least urgent, then newest, first; bounded."""
    cfg = EngineConfig(enable_priority_scheduling=True, priority_preemption_threshold=2, priority_max_preemptions=1)
    now = 0.0
    running = [_req("a", 4, 4, prio=1), _req("b", 4, 4, prio=1), _req("c", 4, 4, prio=4), _req("d", 4, 4, prio=0)]
    for r in running:
        r.created = now
    running[3].kv.retractions = 1  # preempted the most times already
    cand = _req("cand", 4, 4, prio=5)
    assert [r.rid for r in priority.victims(cand, running, cfg, now)] == ["b", "a"]
    free = [0]
    gone: list[str] = []

    def retract(r: Req) -> bool:
        if r.rid == "b":
            return False  # the host pool cannot take it: skipped, never ended
        gone.append(r.rid)
        free[0] += 1
        return True

    assert priority.preempt(cand, running, lambda: free[0] >= 1, retract, cfg, now) == 1 and gone == ["a"]
    assert priority.preempt(cand, running, lambda: True, retract, cfg, now) == 0


# ---- session pins -------------------------------------------------------------------------------------
def _serve(role: ColocatedRole, msg: m.GenerateReq) -> list[int]:
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    role.add(msg)
    while msg.rid not in done:
        collect(role.step(), tokens, done)
    assert done[msg.rid].error is None
    return tokens[msg.rid]


def test_session_pin_keeps_kv_through_pressure_and_is_dropped(model_dir: str) -> None:
    cfg = _cfg(model_dir, max_total_tokens=128, prefix_cache=True, session_timeout_s=60.0)
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, True)
    role = ColocatedRole(cfg, runner, kv)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    first = list(range(1, 27))
    out = _serve(role, generate_req("s1", first, sp, session_id="S"))
    assert len(role.sessions) == 1 and role.sessions.pinned_pages == (26 + 6 - 1) // 4
    for i in range(4):  # other prompts fill and evict the cache; the session's pages stay
        _serve(role, m.GenerateReq(rid=f"o{i}", input_ids=[(i * 50 + j) % 250 + 1 for j in range(40)], sampling=sp))
    assert kv.cache is not None and kv.cache.evicted_pages > 0
    follow = first + out + [9, 8, 7]
    _serve(role, generate_req("s2", follow, sp, session_id="S"))
    assert kv.hit_tokens >= 28  # the next turn computed only its new tokens (and the partial page)
    role.close_session("S")
    assert len(role.sessions) == 0 and kv.cache.evictable_pages == kv.cache.cached_pages
    kv.flush()
    assert kv.all_free()


def test_session_pins_expire_and_relieve(model_dir: str) -> None:
    cfg = _cfg(model_dir, prefix_cache=True)
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, True)
    now = [0.0]
    pins = SessionPins(kv, 5.0, clock=lambda: now[0])
    for sid in ("a", "b"):
        r = _req(sid, 12, 1)
        r.session_id = sid
        kv.grow(r, 12)
        r.kv.kv_len = 12
        r.finish(FinishReason.LENGTH)
        kv.release(r)
        pins.finished([r])
        now[0] += 1
    assert len(pins) == 2 and kv.cache is not None and kv.cache.evictable_pages == 0
    assert pins.relieve() and list(pins.pins) == ["b"]  # the oldest goes first
    now[0] = 100.0
    assert pins.expire() == 1 and not pins.pins and kv.cache.evictable_pages == kv.cache.cached_pages


# ---- the frontend's parse ------------------------------------------------------------------------------
class _Tok:
    def encode(self, text: str) -> list[int]:
        return [ord(c) % 200 + 1 for c in text]


def _limits(store: SessionStore | None = None, role: str = "colocated") -> Limits:
    return Limits(role=role, context_length=256, vocab_size=256, model_name="tiny", sessions=store)


def test_request_options_parse_and_bad_inputs_name_the_field() -> None:
    p = parse_generate({"input_ids": [1, 2], "priority": 7, "extra_key": "tenant"}, _Tok(), _limits())
    assert (p.req.options.priority, p.req.options.extra_key) == (7, "tenant")
    p = parse_completion({"prompt": [1, 2], "cache_salt": "t2", "priority": -3}, _Tok(), _limits())
    assert (p.req.options.priority, p.req.options.extra_key) == (-3, "t2")
    bad = [({"input_ids": [1], "priority": "high"}, "'priority'"),
           ({"input_ids": [1], "priority": 1.5}, "'priority'"),
           ({"input_ids": [1], "extra_key": 5}, "'extra_key'"),
           ({"input_ids": [1], "extra_key": ""}, "'extra_key'"),
           ({"input_ids": [1], "cache_salt": 5}, "'cache_salt'"),
           ({"input_ids": [1], "routing_key": ["k"]}, "'routing_key'"),
           ({"input_ids": [1], "session_params": "s"}, "'session_params'"),
           ({"input_ids": [1], "session_params": {"id": "s", "offset": -5}}, "'session_params': 'offset'"),
           ({"input_ids": [1], "session_params": {"id": "nope"}}, "'session_params.id'")]
    for body, field in bad:
        with pytest.raises(RequestError, match=field):
            parse_generate(body, _Tok(), _limits(SessionStore(60.0)))
    with pytest.raises(RequestError, match="'session_params'"):  # /v1 has no sessions
        parse_completion({"prompt": [1], "session_params": {"id": "s"}}, _Tok(), _limits())
    with pytest.raises(RequestError, match="'session_params'"):  # nor a PD service
        parse_generate({"input_ids": [1], "session_params": {"id": "s"}, "bootstrap_host": "h",
                        "bootstrap_port": 1, "bootstrap_room": 1}, _Tok(), _limits(SessionStore(60.0), "decode"))


def test_session_store_builds_prompts_from_history() -> None:
    now = [0.0]
    store = SessionStore(30.0, clock=lambda: now[0])
    sid = store.open(64)
    with pytest.raises(ValueError, match="already open"):
        store.open(64, sid)
    first = parse_generate({"input_ids": [1, 2, 3], "session_params": {"id": sid}}, _Tok(), _limits(store))
    assert first.req.input_ids == [1, 2, 3] and first.req.options.session_id == sid
    store.record(sid, first.req.rid, [1, 2, 3, 40, 41])
    nxt = parse_generate({"input_ids": [5], "rid": "r2", "session_params": {"id": sid}}, _Tok(), _limits(store))
    assert nxt.req.input_ids == [1, 2, 3, 40, 41, 5]
    store.record(sid, "r2", [1, 2, 3, 40, 41, 5, 60])
    cut = parse_generate({"input_ids": [7], "session_params": {"id": sid, "rid": first.req.rid, "offset": 4}},
                         _Tok(), _limits(store))
    assert cut.req.input_ids == [1, 2, 3, 40, 7]
    with pytest.raises(RequestError, match="'session_params.rid'"):
        parse_generate({"input_ids": [7], "session_params": {"id": sid, "rid": "zz"}}, _Tok(), _limits(store))
    with pytest.raises(RequestError, match="capacity_of_str_len"):
        parse_generate({"input_ids": list(range(1, 70)), "session_params": {"id": sid}}, _Tok(), _limits(store))
    with pytest.raises(RequestError, match="'n'"):
        parse_generate({"input_ids": [1], "sampling_params": {"n": 2}, "session_params": {"id": sid}},
                       _Tok(), _limits(store))
    store.record(sid, "r3", [9, 9], replace=True)
    assert parse_generate({"input_ids": [1], "session_params": {"id": sid}}, _Tok(),
                          _limits(store)).req.input_ids == [9, 9, 1]
    now[0] = 31.0  # idle past the timeout: closed
    with pytest.raises(RequestError, match="no open session"):
        parse_generate({"input_ids": [1], "session_params": {"id": sid}}, _Tok(), _limits(store))
    assert not store.close(sid)


# ---- the router ------------------------------------------------------------------------------------
def test_router_routing_key_keeps_requests_on_one_worker() -> None:
    workers = [Worker(WorkerSpec(url=f"http://w{i}", role="decode")) for i in range(4)]
    policy = CacheAware(PrefixIndex())
    picked: dict[str, set[str]] = {}
    for i in range(24):
        key = f"user-{i % 3}"
        req = parse_request("/generate", {"text": f"a different prompt {i}" * 5, "routing_key": key})
        w = policy.pick(workers, req.prefix)
        picked.setdefault(key, set()).add(w.url)
    assert all(len(urls) == 1 for urls in picked.values())  # each key stays on its worker
    assert len(set().union(*picked.values())) == 3  # and the keys spread over the workers
    assert parse_request("/generate", {"text": "x", "routing_key": "k"}).body["routing_key"] == "k"  # forwarded
    for body, field in (({"text": "x", "routing_key": 3}, "'routing_key'"),
                        ({"text": "x", "session_params": {"id": "s"}}, "'session_params'")):
        with pytest.raises(BadRequest, match=field):
            parse_request("/generate", body)


# ---- cache salt in PD (in-process prefill + decode, fake transfer backend) ---------------------------
def test_pd_decode_reuse_stays_within_one_salt(model_dir: str) -> None:
    """A salted prompt seen before is reused by the decode (its hash, with the salt, matches the
    prefill's check: no refusal); another salt or none reuses nothing, on either side."""
    cfg = EngineConfig(model=model_dir, max_total_tokens=2048, host_kv_tokens=1024, page_size=4,
                       chunked_prefill_size=16, max_prefill_tokens=64, prefix_cache=True)
    pair = PDPair(cfg, decode_cache=True)
    try:
        prompt = [(7 * i + 3) % 250 + 1 for i in range(30)]
        sp = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)
        want, _, _ = pair.run([prompt], sp, fields={"extra_key": "A"}, room_base=100)
        got, done, _ = pair.run([prompt], sp, fields={"extra_key": "A"}, room_base=200)
        counters = pair.decode.stats().counters
        assert got == want and done["r0"].cached_tokens > 0
        assert counters.kv_pages_reused_on_decode > 0 and counters.kv_prefix_refused_by_prefill == 0
        reused = counters.kv_pages_reused_on_decode
        for room, fields in ((300, {"extra_key": "B"}), (400, {})):
            got, done, _ = pair.run([prompt], sp, fields=fields, room_base=room)
            assert got == want and done["r0"].cached_tokens == 0
        assert pair.decode.stats().counters.kv_pages_reused_on_decode == reused
    finally:
        pair.close()


def test_salted_choices_keep_their_pages_in_the_salt(model_dir: str) -> None:
    """n > 1 under a salt: every choice shares and returns its pages in the salted namespace."""
    cfg = _cfg(model_dir, max_total_tokens=256, prefix_cache=True)
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, True)
    role = ColocatedRole(cfg, runner, kv)
    sp = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    ids = list(range(1, 22))
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    role.add(generate_req("n2", ids, sp, n=2, extra_key="A"))
    while len(done) < 2:
        collect(role.step(), tokens, done)
    assert all(o.error is None for o in done.values())
    plain = Req(rid="p", token_ids=ids, sampling=sp)
    salted = Req(rid="s", token_ids=ids, sampling=sp, options=ReqOptions(extra_key="A"))
    assert kv.prefix_len(plain) == 0 and kv.prefix_len(salted) == 20
    kv.flush()
    assert kv.all_free()


# ---- priority on a PD decode (in-process prefill + decode, fake transfer backend) ---------------------
def _pd_run(model_dir: str, prio: bool) -> tuple[dict[str, list[int]], int, int]:
    """Two long low-priority requests fill the decode's 64-token pool; an urgent one comes from the
    prefill. Returns the outputs, the decode steps the urgent one waited for its first token, and
    the decode's retractions."""
    cfg = _cfg(model_dir, max_total_tokens=256, enable_priority_scheduling=prio)
    pair = PDPair(cfg, decode_cfg=_cfg(model_dir, enable_priority_scheduling=prio))
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    sp = SamplingParams(temperature=0.0, max_new_tokens=14, ignore_eos=True)

    def add(rid: str, ids: list[int], new: int, prio_: int, room: int) -> None:
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.p_mgr.bootstrap_port, "bootstrap_room": room}
        msg = generate_req(rid, ids, SamplingParams(**{**vars(sp), "max_new_tokens": new}), priority=prio_, **boot)
        pair.prefill.add(msg)
        collect(pair.decode.add(msg), tokens, done)

    def step() -> None:
        pair.prefill.step()
        collect(pair.decode.step(), tokens, done)

    try:
        for i, seed in enumerate((1, 2)):
            add(f"low{i}", _req("x", 16, 1, seed=seed).token_ids, 14, 0, 10 + i)
        while not all(len(tokens.get(f"low{i}", [])) >= 8 for i in range(2)):
            step()
        add("high", _req("x", 20, 1, seed=3).token_ids, 4, 10, 20)  # 5 pages; fewer are free
        waited = 0
        while not tokens.get("high"):
            step()
            waited += 1
        while len(done) < 3:
            step()
        assert all(o.error is None for o in done.values())
        assert pair.d_kv.all_free()
        return tokens, waited, pair.d_kv.retractions
    finally:
        pair.close()


def test_priority_preempts_on_a_pd_decode_with_outputs_unchanged(model_dir: str) -> None:
    """The decode's admission is the scheduler's too: an urgent request whose KV does not fit
    retracts a less urgent running one (which reloads and finishes unchanged) instead of waiting."""
    plain, waited_plain, _ = _pd_run(model_dir, prio=False)
    urgent, waited_urgent, retracted = _pd_run(model_dir, prio=True)
    assert retracted >= 1
    assert waited_urgent < waited_plain
    assert urgent == plain
