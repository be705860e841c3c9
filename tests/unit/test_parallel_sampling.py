"""Parallel sampling (n > 1, engine.scheduling.parallel) over a tiny random-weight model: the prompt is computed
once and its full pages shared by the n choices (cache on, and off through the private fork tree),
greedy choices equal the n=1 answer, seeded choices differ yet are reproducible and equal in PD and
colocated, and every page is freed after a finish or an abort."""

from __future__ import annotations

import pytest

from colocated_service.worker import ColocatedRole
from common.api_schema import ChatCompletionRequest, CompletionRequest
from engine.config import EngineConfig
from engine.kvcache.memory import pages_for
from engine.sampling.params import SamplingParams
from engine.scheduling.parallel import MAX_N, choice_seed
from service import messages as m
from tests.pd_harness import PDPair, collect, colocated_tokens, kv_manager
from tests.tiny_model import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_new_tokens=6, ignore_eos=True)
PROMPT = [(7 * i + 3) % 250 for i in range(37)]  # 9 full pages of 4 + 1 token


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def _cfg(model_dir: str, cache: bool, **kw: object) -> EngineConfig:
    base = dict(model=model_dir, max_total_tokens=1024, host_kv_tokens=512, page_size=4,
                chunked_prefill_size=64, max_prefill_tokens=64, prefix_cache=cache)
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def _role(model_dir: str, cache: bool) -> ColocatedRole:
    from engine.forward.model_runner import ModelRunner

    cfg = _cfg(model_dir, cache)
    runner = ModelRunner(cfg)
    return ColocatedRole(cfg, runner, kv_manager(runner, cache))


def test_choice_seeds_differ_and_keep_choice_zero() -> None:
    seeds = [choice_seed(1234, i) for i in range(64)]
    assert seeds[0] == 1234 and len(set(seeds)) == 64 and all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(None, 3) is None
    for model in (ChatCompletionRequest, CompletionRequest):  # the OpenAPI document names the same limit
        assert f"1..{MAX_N}" in (model.model_fields["n"].description or "")


@pytest.mark.parametrize("cache", [True, False])
def test_prompt_computed_once_and_pages_shared(model_dir: str, cache: bool) -> None:
    role = _role(model_dir, cache)
    kv, ps = role.kv, 4
    role.add(m.GenerateReq(rid="a", input_ids=PROMPT, sampling=GREEDY, n=4))
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    collect(role.step(), tokens, done)  # the whole prompt in one chunk, four first tokens
    assert role.sched.exec.forward_tokens == len(PROMPT)
    assert role.sched.counts().running == 4 and sorted(tokens) == ["a", "a#1", "a#2", "a#3"]
    full = len(PROMPT) // ps
    assert kv.used_tokens == (full + 4) * ps  # one copy of the full pages, a partial page per choice
    assert 4 * pages_for(len(PROMPT), ps) * ps > 2 * kv.used_tokens  # 4 requests would hold 40 pages
    while len(done) < 4:
        collect(role.step(), tokens, done)
    assert role.sched.exec.forward_tokens == len(PROMPT) + 4 * (GREEDY.max_new_tokens - 1)
    alone = colocated_tokens(_cfg(model_dir, cache), [PROMPT], GREEDY)["r0"]
    assert all(tokens[k] == alone for k in tokens)  # greedy: n identical answers, those of n=1
    assert all(o.prompt_tokens == len(PROMPT) and o.completion_tokens == 6 for o in done.values())
    kv.flush()
    assert kv.all_free() and kv.used_tokens == 0


def test_seeded_choices_differ_and_reproduce(model_dir: str) -> None:
    cfg = _cfg(model_dir, True)
    first = colocated_tokens(cfg, [PROMPT], SEEDED, n=3)
    again = colocated_tokens(cfg, [PROMPT], SEEDED, n=3)
    alone = colocated_tokens(cfg, [PROMPT], SEEDED)
    assert first == again and first["r0"] == alone["r0"]  # choice 0 is the n=1 answer
    assert len({tuple(t) for t in first.values()}) == 3


def test_abort_before_and_after_the_fork_frees_everything(model_dir: str) -> None:
    role = _role(model_dir, True)
    long = SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    for rid in ("early", "late"):
        role.add(m.GenerateReq(rid=rid, input_ids=PROMPT + [1, 2], sampling=long, n=3))
    role.step()
    role.step()  # one prompt per step (max_prefill_tokens 64)
    assert role.sched.counts().running == 6
    role.abort(m.AbortReq(rid="late"))
    outs = role.step()
    aborted = [o for o in outs if o.rid == "late" and o.finish_reason == "abort"]
    assert sorted(o.index for o in aborted) == [0, 1, 2] and role.sched.counts().running == 3
    role.add(m.GenerateReq(rid="queued", input_ids=list(range(5, 40)), sampling=long, n=3))
    role.abort(m.AbortReq(rid="queued"))  # before its prompt ran: its forks end with it
    outs = role.step()
    assert sorted(o.index for o in outs if o.rid == "queued" and o.finished) == [0, 1, 2]
    role.abort(m.AbortReq(abort_all=True))
    role.step()
    role.kv.flush()
    assert role.kv.all_free() and not role.sched.has_work()


@pytest.mark.parametrize("decode_cache", [False, True])
def test_pd_seeded_choices_equal_colocated_and_decode_shares_pages(model_dir: str, decode_cache: bool) -> None:
    """PD (fake data backend, real zmq): the prefill samples the three first tokens, the decode forks
    the received KV; the texts equal colocated's, and the decode holds one copy of the full pages.
    With the decode's own prefix cache, a second run finds the prompt there (decode-side reuse) and
    forks over the matched pages."""
    cfg = _cfg(model_dir, True)
    colo = colocated_tokens(cfg, [PROMPT], SEEDED, n=3)
    pair = PDPair(cfg, decode_cache=decode_cache)
    peak = [0]

    def watch(p: PDPair) -> None:
        peak[0] = max(peak[0], p.d_kv.used_tokens)

    try:
        tokens, d_done, p_done = pair.run([PROMPT], SEEDED, on_step=watch, fields={"n": 3})
        assert tokens == colo and len(d_done) == 3 and list(p_done) == ["r0"]
        assert all(o.prompt_tokens == len(PROMPT) and o.completion_tokens == 6 for o in d_done.values())
        assert pair.prefill.stats().counters.forward_tokens == len(PROMPT)  # computed once
        full, ps = len(PROMPT) // 4, 4
        # full pages once + per choice: the partial prompt page and the pages its 6 tokens fill
        assert peak[0] <= (full + 3 * pages_for(len(PROMPT) % ps + 6, ps)) * ps
        if decode_cache:
            again, _, _ = pair.run([PROMPT], SEEDED, fields={"n": 3}, room_base=200)
            assert again == colo and pair.decode.reuse["pages"] == full
            pair.d_kv.flush()
        assert pair.d_kv.all_free() and pair.d_kv.used_tokens == 0
    finally:
        pair.close()


def test_sliding_window_choices_copy_the_live_pages(tmp_path) -> None:  # noqa: ANN001
    """A windowed model has no fork tree (a trim would free a shared page): each choice copies the
    live pages; greedy choices equal n=1 and every page is freed."""
    model = str(make_tiny_model(tmp_path / "swa", model_type="mistral", sliding_window=8))
    cfg = _cfg(model, False)
    alone = colocated_tokens(cfg, [PROMPT], GREEDY)["r0"]
    forked = colocated_tokens(cfg, [PROMPT], GREEDY, n=3)  # asserts every page is freed
    assert list(forked.values()) == [alone] * 3


def test_choices_retract_and_reload_with_unchanged_outputs(model_dir: str) -> None:
    """A pool too small for 4 choices of 16 tokens: choices are retracted to the host (their shared
    pages copied, the lock on the private fork tree dropped) and reloaded into fresh pages; outputs
    equal a big pool's. Cache off: the decode's case on this branch (the cache-on lock is the prefix
    cache's, whose retraction tests/unit/test_prefix_cache.py covers)."""
    cache = False
    long = SamplingParams(temperature=1.0, seed=5, max_new_tokens=16, ignore_eos=True)
    big = colocated_tokens(_cfg(model_dir, cache), [PROMPT], long, n=4)
    from engine.forward.model_runner import ModelRunner

    cfg = _cfg(model_dir, cache, max_total_tokens=80, new_token_ratio=0.0)
    runner = ModelRunner(cfg)
    kv = kv_manager(runner, cache)
    role = ColocatedRole(cfg, runner, kv)
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    role.add(m.GenerateReq(rid="r0", input_ids=PROMPT, sampling=long, n=4))
    while len(done) < 4:
        collect(role.step(), tokens, done)
    assert tokens == big and kv.retractions > 0 and kv.reloads == kv.retractions
    kv.flush()
    assert kv.all_free()


def test_pd_local_prefill_on_the_decode_forks_too(model_dir: str) -> None:
    """Conditional disaggregation: a short prompt prefilled on the decode itself gives the same n=3
    seeded choices (the decode's Scheduler forks as the colocated one does)."""
    cfg = _cfg(model_dir, True)
    pair = PDPair(cfg, local_threshold=len(PROMPT))
    try:
        tokens, d_done, _ = pair.run([PROMPT], SEEDED, fields={"n": 3})
        assert pair.decode.prefills["local"] == 1 and len(d_done) == 3
        assert tokens == colocated_tokens(cfg, [PROMPT], SEEDED, n=3)
        assert pair.d_kv.all_free()
    finally:
        pair.close()
