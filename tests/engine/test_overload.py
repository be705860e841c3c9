"""Issue 53, part 1: a request the KV pool can never hold answers at once, and one that outgrows the
whole pool while it decodes ends there (finish reason length, saying why) instead of being retracted
and waiting forever for room that cannot come: colocated, a PD decode, speculation, n > 1. A tiny
random-weight model; every loop is bounded by a step count, so a stall fails instead of hanging."""

from __future__ import annotations

import pytest
import torch

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.extras.speculative.config import SpecConfig
from engine.forward.model_runner import ModelRunner
from engine.sampling.params import SamplingParams
from service import messages as m
from service.watchdog import QUEUED, WAITING_KV, Watchdog
from tests.pd_harness import PDPair, collect, generate_req, kv_manager
from tests.tiny_model import make_tiny_model

POOL = 96  # tokens: 24 pages of 4
MAX_STEPS = 2000  # far more than any request here needs


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    torch.set_num_threads(1)
    return str(make_tiny_model(tmp_path_factory.mktemp("overload")))


def _cfg(model: str, **kw: object) -> EngineConfig:
    base = dict(model=model, max_total_tokens=POOL, host_kv_tokens=512, page_size=4, chunked_prefill_size=32,
                max_prefill_tokens=64, threads=1, new_token_ratio=0.0)
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def _serve(role: ColocatedRole, msgs: list[m.GenerateReq]) -> dict[str, m.TokenOut]:
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    want = sum(x.n for x in msgs)
    for x in msgs:
        collect(role.add(x), tokens, done)
    for _ in range(MAX_STEPS):
        if len(done) == want:
            break
        collect(role.step(), tokens, done)
    assert len(done) == want, f"stalled: {role.stats().queues}"
    for k, o in done.items():
        assert o.completion_tokens == len(tokens.get(k, [])) or o.error_code == 400
    return done


def _role(cfg: EngineConfig) -> ColocatedRole:
    runner = ModelRunner(cfg)
    return ColocatedRole(cfg, runner, kv_manager(runner, cfg.prefix_cache))


PROMPT = [(7 * i) % 250 + 1 for i in range(50)]
LONG = SamplingParams(temperature=0.0, max_new_tokens=80, ignore_eos=True)  # 50 + 80 > 96


@pytest.mark.parametrize("spec", [None, SpecConfig(speculative="ngram", num_speculative_tokens=3, ngram_min=1,
                                                    ngram_max=2)], ids=["plain", "ngram"])
def test_colocated_request_outgrowing_the_pool_ends_there(model: str, spec: SpecConfig | None) -> None:
    role = _role(_cfg(model, **({"spec": spec} if spec else {})))
    out = _serve(role, [generate_req("big", PROMPT, LONG)])["big"]
    assert out.finish_reason == "length" and out.error_code == 0, out
    assert "KV pool is full" in (out.error or "") and str(POOL) in out.error
    assert out.completion_tokens == POOL - len(PROMPT) + 1  # the pool holds the KV of all but the last
    assert role.stats().counters.pool_truncated == 1
    assert role.kv.all_free()


def test_colocated_two_that_fit_alone_both_finish_whole(model: str) -> None:
    """Two 50 + 40 requests (each fits, both do not): one is retracted and reloaded, neither truncated."""
    role = _role(_cfg(model))
    sp = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    done = _serve(role, [generate_req("a", PROMPT, sp), generate_req("b", PROMPT[::-1], sp)])
    assert all(o.finish_reason == "length" and o.error is None and o.completion_tokens == 40 for o in done.values())
    assert role.kv.retractions > 0 and role.stats().counters.pool_truncated == 0


def test_prompt_that_never_fits_is_a_400_naming_sizes(model: str) -> None:
    role = _role(_cfg(model))
    done = _serve(role, [generate_req("huge", list(range(1, 120)), LONG),
                         generate_req("forks", PROMPT + PROMPT[:36], LONG, n=4)])
    assert done["huge"].error_code == 400 and "119 tokens" in done["huge"].error and str(POOL) in done["huge"].error
    # 86 prompt tokens fit (22 pages); its 3 other choices' partial last pages do not (22 + 3 > 24)
    assert done["forks"].error_code == 400 and "4 choices" in done["forks"].error, done["forks"]
    assert role.kv.all_free()


def test_n_choices_outgrowing_the_pool_each_end(model: str) -> None:
    """n = 3 over a 40-token prompt: the choices share its pages, each grows until the pool is full;
    retracted ones come back and every choice ends (none waits forever)."""
    role = _role(_cfg(model))
    done = _serve(role, [generate_req("n3", PROMPT[:40], LONG, n=3)])
    assert len(done) == 3 and all(o.finish_reason == "length" and o.error_code == 0 for o in done.values())
    assert any("KV pool is full" in (o.error or "") for o in done.values())
    role.kv.flush()
    assert role.kv.all_free()


def test_pd_decode_request_outgrowing_its_pool_ends_there(model: str) -> None:
    """The decode's pool is the small one (the prefill's is large): it ends the request at its end."""
    pair = PDPair(_cfg(model, max_total_tokens=1024), decode_cfg=_cfg(model))
    try:
        tokens, d_done, p_done = pair.run([PROMPT], LONG, timeout_s=60)
        out = d_done["r0"]
        assert out.finish_reason == "length" and "KV pool is full" in (out.error or ""), out
        assert len(tokens["r0"]) == POOL - len(PROMPT) + 1 and p_done["r0"].error is None
        assert pair.d_kv.all_free() and pair.p_kv.all_free()
    finally:
        pair.close()


# ---- the watchdog (part 3): the clock is the test's, one "second" per step ---------------------------
def _watch(role: ColocatedRole, msgs: list[m.GenerateReq], dog: Watchdog) -> dict[str, m.TokenOut]:
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    for x in msgs:
        collect(role.add(x), tokens, done)
    for now in range(MAX_STEPS):
        if len(done) == len(msgs):
            return done
        collect(role.step(), tokens, done)
        dog.check(role.progress, role.fail, float(now))
    raise AssertionError(f"stalled: {role.stats().queues}")


def test_watchdog_ends_a_stuck_request_naming_its_stage(model: str, caplog: pytest.LogCaptureFixture) -> None:
    """A scheduler that never admits anything (injected: its planner plans nothing) leaves a request
    queued while the worker computes nothing: the watchdog ends it after the timeout, a 503 naming
    the stage, logged once and counted."""
    role = _role(_cfg(model, max_total_tokens=1024))
    role.sched.planner.plan = lambda *a, **k: []  # type: ignore[method-assign]
    dog = Watchdog(timeout_s=5)
    with caplog.at_level("WARNING", logger="pdserve.watchdog"):
        out = _watch(role, [generate_req("stuck", PROMPT, LONG)], dog)["stuck"]
    assert out.error_code == 503 and out.finish_reason == "error", out
    assert "no progress for" in out.error and QUEUED in out.error and "--watchdog-timeout 5" in out.error
    assert dog.ended == 1 and dog.by_stage == {QUEUED: 1}
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1 and len(caplog.records) == 1
    assert role.kv.all_free()


def test_watchdog_leaves_moving_and_queued_requests_alone(model: str) -> None:
    """Over many more "seconds" than the timeout: a decoding request moves every step, and one queued
    behind it (the pool holds one at a time) moves with the worker: neither is ended."""
    role = _role(_cfg(model, new_token_ratio=1.0))
    sp = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)  # 50 + 40 each: one at a time
    dog = Watchdog(timeout_s=3)
    done = _watch(role, [generate_req("a", PROMPT, sp), generate_req("b", PROMPT[::-1], sp)], dog)
    assert all(o.error is None and o.completion_tokens == 40 for o in done.values()), done
    assert dog.ended == 0


def test_watchdog_ends_a_decode_request_whose_kv_never_comes(model: str) -> None:
    """A prefill that never steps (injected: the test does not step it) leaves the decode's request
    waiting for its KV: the watchdog ends it, naming that stage, and every page is freed."""
    pair = PDPair(_cfg(model))
    dog = Watchdog(timeout_s=5)
    try:
        boot = {"bootstrap_host": "127.0.0.1", "bootstrap_port": pair.p_mgr.bootstrap_port, "bootstrap_room": 7}
        done: dict[str, m.TokenOut] = {}
        collect(pair.decode.add(generate_req("r", PROMPT, LONG, **boot)), {}, done)
        for now in range(60):
            collect(pair.decode.step(), {}, done)
            dog.check(pair.decode.progress, pair.decode.fail, float(now))
            if done:
                break
        out = done["r"]
        assert out.error_code == 503 and WAITING_KV in out.error and dog.by_stage == {WAITING_KV: 1}, out
        assert pair.d_kv.all_free() and not pair.decode.transfer
    finally:
        pair.close()
