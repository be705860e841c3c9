"""Serving hybrid recurrent models (issue 48): the scheduler, the KV manager and PD with a state slot
per request, on one Gated DeltaNet family (Qwen3-Next) and one Mamba2 family (Nemotron-H), tiny
random-weight models (tests/hybrid_models.py); transformers is the oracle.

Per family: greedy tokens equal to transformers' argmax at every step, alone and in one continuous
batch; a pool too small for the batch retracts requests (state saved to the host with the KV) and
the outputs do not change; n > 1 choices fork the prompt's state; fewer state slots than requests
make requests wait, not fail; an abort storm leaves every page and slot free; priority preemption with
one state slot saves and reloads the preempted request's state; the in-process PD pair (the state
rides the KV transfer as extra wire pages) equals colocated; speculation rolls the state back to the last
kept position; LoRA on the attention layers equals transformers + peft. Then what is refused. Last, one
real stack (router, a TP 2 prefill, two TP 1 decodes speculating, Nemotron-H): answers equal colocated,
and a stream migrates off a killed decode with the same tokens. (PD across unequal TP in process: test_hybrid_pd_tp.py.)
"""

from __future__ import annotations

import httpx
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLM
from engine.extras.speculative.config import SpecConfig
from engine.forward.model_runner import ModelRunner
from engine.request import Req
from engine.sampling.params import SamplingParams
from tests.hybrid_models import CONFIGS, VOCAB, write_hybrid
from tests.pd_harness import colocated_tokens, pd_equals_colocated, router_equals_colocated, router_stack

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
LENGTHS = (5, 70, 200)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _cfg(path: str, **kw: object) -> EngineConfig:
    base = dict(model=path, max_total_tokens=4096, host_kv_tokens=2048, page_size=16, chunked_prefill_size=64,
                max_prefill_tokens=256, threads=1)
    return EngineConfig(**(base | kw))


@pytest.fixture(scope="module", params=list(CONFIGS))
def family(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(1)
    dst = tmp_path_factory.mktemp(request.param)
    hf = write_hybrid(request.param, dst)
    return request.param, hf, str(dst)


@pytest.fixture(scope="module")
def llm(family):  # noqa: ANN001, ANN201
    return LLM(_cfg(family[2]))


def _argmax_path(hf, ids: list[int], out: list[int]) -> list[int]:  # noqa: ANN001
    with torch.no_grad():
        return hf(torch.tensor([ids + out[:-1]])).logits[0].argmax(-1).tolist()[len(ids) - 1:]


def test_greedy_alone_and_batched_match_transformers(family, llm):
    _, hf, _ = family
    prompts = [_prompt(10 + n, n) for n in LENGTHS]
    alone = [llm.generate([ids], GREEDY)[0].output_ids for ids in prompts]
    for ids, out in zip(prompts, alone):
        assert _argmax_path(hf, ids, out) == out, "greedy tokens differ from transformers' argmax"
    assert [c.output_ids for c in llm.generate(prompts, GREEDY)] == alone
    kv = llm.scheduler.kv
    assert kv.all_free() and kv.states is not None and kv.states.num_used == 0
    info = llm.runner.server_info()
    assert info["state_slots"] == 64 and info["state_bytes_per_slot"] == kv.states.slot_bytes > 0


def test_retraction_saves_the_state_with_the_kv(family, llm):
    prompts = [_prompt(30 + i, 40 + 9 * i) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    want = [c.output_ids for c in llm.generate(prompts, params)]
    small = LLM(_cfg(family[2], max_total_tokens=256, new_token_ratio=0.0))
    outs = small.generate(prompts, params)
    kv = small.scheduler.kv
    assert kv.retractions > 0, "the pool was meant to be too small"
    assert kv.reloads == kv.retractions
    assert [c.output_ids for c in outs] == want and all(c.error is None for c in outs)
    assert kv.all_free()


def test_fewer_state_slots_than_requests_wait_not_fail(family, llm):
    prompts = [_prompt(50 + i, 20 + 5 * i) for i in range(5)]
    want = [c.output_ids for c in llm.generate(prompts, GREEDY)]
    two = LLM(_cfg(family[2], max_state_slots=2))
    peak = 0
    reqs = [Req(rid=f"s{i}", token_ids=ids, sampling=GREEDY) for i, ids in enumerate(prompts)]
    for r in reqs:
        two.scheduler.add(r)
    while any(not r.finished for r in reqs):
        two.scheduler.step()
        two.scheduler.drain()
        peak = max(peak, two.scheduler.kv.states.num_used)
    assert peak == 2 and [r.output_ids for r in reqs] == want and all(r.error is None for r in reqs)
    assert two.scheduler.kv.all_free()


def test_n_choices_fork_the_prompt_state(family):
    cfg = _cfg(family[2])
    ids = [_prompt(70, 90)]
    one = colocated_tokens(cfg, ids, GREEDY)["r0"]
    three = colocated_tokens(cfg, ids, GREEDY, n=3)  # greedy: every choice decodes the same tokens
    assert three == {"r0": one, "r0#1": one, "r0#2": one}


def test_an_abort_storm_frees_every_page_and_slot(family, llm):
    sched = llm.scheduler
    reqs = [Req(rid=f"a{i}", token_ids=_prompt(90 + i, 30 + 20 * i), sampling=GREEDY) for i in range(8)]
    for r in reqs:
        sched.add(r)
    for _ in range(3):
        sched.step()
    assert sched.kv.states.num_used > 0
    sched.abort(everything=True)
    sched.step()
    sched.drain()
    assert sched.kv.all_free() and sched.kv.states.num_used == 0


def test_priority_preemption_saves_and_reloads_the_state(family, llm):
    """One state slot: a running low-priority request holds it; an urgent arrival preempts it (its state
    saved to the host with its KV, the slot freed), runs, and the low one reloads its state and ends with
    the tokens it has alone."""
    from engine.request_groups import ReqOptions

    low_ids, high_ids = _prompt(60, 50), _prompt(61, 30)
    low_sp = SamplingParams(temperature=0.0, max_new_tokens=30, ignore_eos=True)
    want = {"low": llm.generate([low_ids], low_sp)[0].output_ids,
            "high": llm.generate([high_ids], GREEDY)[0].output_ids}
    one = LLM(_cfg(family[2], max_state_slots=1, enable_priority_scheduling=True))
    sched, kv = one.scheduler, one.scheduler.kv
    low = Req(rid="low", token_ids=low_ids, sampling=low_sp, options=ReqOptions(priority=0))
    high = Req(rid="high", token_ids=high_ids, sampling=GREEDY, options=ReqOptions(priority=10))
    sched.add(low)
    while low.num_output_tokens < 5:
        sched.step()
    sched.add(high)
    while not high.finished:
        sched.step()
        assert kv.slots_used <= 1
    assert kv.retractions == 1 and not low.finished, "the urgent request did not preempt the low one"
    while sched.has_work():
        sched.step()
        sched.drain()
    assert kv.reloads == 1 and low.error is None and high.error is None
    assert {"low": low.output_ids, "high": high.output_ids} == want
    assert kv.all_free() and kv.states.num_used == 0


def test_pd_in_process_equals_colocated(family):
    pd_equals_colocated(_cfg(family[2]), [_prompt(7, 21), _prompt(8, 150)], GREEDY, heartbeat_s=5.0)


class _Oracle:
    """A proposer (the Speculator's draft side) that knows each prompt's greedy continuation: every draft
    holds its K next true tokens with the first `right` kept and the rest made wrong, `right` cycling
    through 0..K, so the verifies keep every prefix of their drafts and roll the state back to each
    position in turn. Test-only: the target model and its verifies are real."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]]) -> None:
        self.truth, self.turn, self.right = truth, 0, 0

    def propose(self, reqs: list[Req], lens: list[int]) -> None:
        for r, n in zip(reqs, lens):
            true = self.truth[tuple(r.token_ids[: r.num_prompt_tokens])][r.num_output_tokens : r.num_output_tokens + n]
            right = self.turn % (n + 1)
            self.turn += 1
            self.right += min(right, len(true))
            r.spec.draft = true[:right] + [(t + 1) % VOCAB for t in true[right:]]

    def rollback(self, r: Req) -> None: ...
    def forget(self, r: Req) -> None: ...
    def retain(self, running: list[Req]) -> None: ...

    def used_pages(self) -> int:
        return 0


def test_speculation_rolls_the_state_back_to_the_last_kept_position(family, llm):
    """--speculative on a hybrid model: each verify runs its positions one at a time through the recurrent
    layers, keeping the state after each (engine/extras/speculative/states.py). Drafts of K = 3 whose
    first 0..3 tokens are the true ones (a proposer that knows the answer) are verified in one batch of
    three requests: the tokens equal plain decoding's, every true draft token is accepted and every wrong
    one rejected, and every page and state slot comes back."""
    prompts = [_prompt(110 + i, n) for i, n in enumerate((9, 40, 130))]
    params = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
    want = [c.output_ids for c in llm.generate(prompts, params)]
    spec = LLM(_cfg(family[2], spec=SpecConfig(speculative="ngram", num_speculative_tokens=3,
                                                speculative_min_acceptance=0.0)))
    oracle = _Oracle({tuple(ids): out for ids, out in zip(prompts, want)})
    spec.scheduler.spec.draft = oracle
    outs = spec.generate(prompts, params)
    assert [c.output_ids for c in outs] == want and all(c.error is None for c in outs)
    totals = spec.scheduler.spec.stats()
    assert totals.accepted_tokens == oracle.right > 0
    assert totals.proposed_tokens - totals.accepted_tokens > 0, "no draft token was rejected"
    kv = spec.scheduler.kv
    assert kv.all_free() and kv.verify_held == 0 and kv.verify_slots == 3 * 8
    assert spec.runner.server_info()["state_verify_slots"] == 24


def test_lora_on_the_attention_layers_matches_peft(family, tmp_path):
    """LoRA on a hybrid model: an adapter on the attention layers' q/k/v/o (Qwen3-Next's q_proj rows are
    [q | gate] per head, sliced so), nothing on the recurrent layers. Greedy tokens equal transformers + peft
    with the same adapter at every step (teacher-forced argmax), in one batch with base requests, which keep
    the base model's tokens; the adapter changes the output; an adapter naming the MLP is refused by name."""
    from engine.config import ModelConfig
    from engine.extras.lora.adapter import write_random_adapter
    from tests.engine.test_lora import make_adapter

    _, hf, path = family
    pm = make_adapter(hf, tmp_path / "a", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False, seed=5)
    llm = LLM(_cfg(path, lora_paths=(f"a={tmp_path / 'a'}",), max_lora_rank=8))
    prompts = [_prompt(130 + i, n) for i, n in enumerate((7, 70))]
    params = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    outs = [c.output_ids for c in llm.generate(prompts * 2, params, loras=["a", "a", "", ""])]
    for ids, out in zip(prompts, outs[:2]):
        assert _argmax_path(pm, ids, out) == out, "the adapter's greedy tokens differ from transformers + peft"
    for ids, out in zip(prompts, outs[2:]):
        assert _argmax_path(hf, ids, out) == out, "a base request beside the adapter's differs from the base model"
    assert outs[:2] != outs[2:], "the adapter did not change the output"
    assert llm.scheduler.kv.all_free()
    write_random_adapter(tmp_path / "mlp", ModelConfig.from_dir(path), 4, ("q_proj", "down_proj"))
    with pytest.raises(ValueError, match="MLP of a (hybrid recurrent|mixture-of-experts) model"):
        LLM(_cfg(path, lora_paths=(f"m={tmp_path / 'mlp'}",), max_lora_rank=8))


@pytest.mark.parametrize("field,value,words", [
    ("draft_model", "self", "draft model must be attention-only"),
    ("hicache_dir", "hicache", "--hicache-dir"),
])
def test_what_is_refused_says_so(family, field, value, words):
    if field == "draft_model":  # the hybrid model as its own draft
        llm_cfg = _cfg(family[2], spec=SpecConfig(speculative="draft", draft_model=family[2]))
        with pytest.raises(ValueError, match=f"has recurrent layers: a {words}"):
            LLM(llm_cfg)
        return
    kw = {"prefix_cache": True, "hicache_host_tokens": 1024} if field == "hicache_dir" else {}
    with pytest.raises(ValueError, match=f"has recurrent layers; {words}"):
        ModelRunner(_cfg(family[2], **{field: value}, **kw))


# ---- one real PD stack through the router -------------------------------------------------------

@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory):  # noqa: ANN001, ANN201
    """Nemotron-H: colocated, a prefill at TP 2 (its ranks' state gathered into the wire's whole layout),
    two decodes at TP 1 speculating with n-gram drafts (separate processes, real UCX), the router over them."""
    model = tmp_path_factory.mktemp("hybrid_pd")
    write_hybrid("nemotron_h", model)
    spec = ("--speculative", "ngram", "--speculative-min-acceptance", "0")  # the pair's compatibility record
    with router_stack(model, ("--tp", "2", *spec), decodes=2, decode_args=spec) as procs:
        yield procs


@pytest.mark.slow
def test_real_pd_through_router_equals_colocated(pd_stack):
    router_equals_colocated(pd_stack, [_prompt(1, 13), _prompt(2, 90)])
    router_equals_colocated(pd_stack, [_prompt(1, 13)], tokens=32)  # its text repeats: n-gram drafts
    info = httpx.get(pd_stack["dec"].url + "/server_info", timeout=30).json()
    assert info["state_slots"] > 0 and info["state_bytes_per_slot"] > 0
    proposed = [httpx.get(pd_stack[d].url + "/server_info", timeout=30).json()["internal_states"][0]["speculative"]
                ["proposed_tokens"] for d in ("dec", "dec2")]
    assert sum(proposed) > 0, "no decode speculated"
    assert info["state_snapshot_slots"] == 0  # the decode keeps no prefix cache for a hybrid model
    for role in ("colo", "pre"):  # theirs is on by default: state snapshots beside the requests' slots
        info = httpx.get(pd_stack[role].url + "/server_info", timeout=30).json()
        assert info["state_snapshot_slots"] == info["state_slots"] // 2 > 0


@pytest.mark.slow
def test_a_stream_migrates_off_a_killed_decode_with_its_state(pd_stack):
    """Mid-stream migration (router/migration.py) on a hybrid model: the decode streaming a /generate answer
    is killed (-9) after a few tokens; the router resumes it on the other decode (the prefill recomputes
    prompt + streamed tokens, state included, and ships the state again) and the whole answer equals the
    colocated one. Runs last: it kills "dec"."""
    import json
    import signal
    import threading

    router, victim, survivor = pd_stack["router"].url, pd_stack["dec"], pd_stack["dec2"]
    ids = _prompt(3, 40)
    sampling = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
    want = httpx.post(pd_stack["colo"].url + "/generate", json={"input_ids": ids, "sampling_params": sampling},
                      timeout=120).json()["output_ids"]
    httpx.delete(router + "/admin/workers", params={"url": survivor.url}, timeout=10).raise_for_status()
    killed = threading.Event()
    events: list[dict] = []
    with httpx.Client(timeout=300) as c, c.stream("POST", router + "/generate", json={
            "input_ids": ids, "sampling_params": sampling, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            events.append(json.loads(line[6:]))
            if len(events) == 3 and not killed.is_set():  # the stream runs on the victim: the survivor back, kill
                httpx.post(router + "/admin/workers", json={"url": survivor.url, "role": "decode"},
                           timeout=10).raise_for_status()
                victim.signal(signal.SIGKILL, group=True)
                killed.set()
    assert killed.is_set() and not any("error" in e for e in events), events[-2:]
    assert events[-1]["output_ids"] == want, "the migrated answer differs from colocated"
    metrics = httpx.get(router + "/metrics", timeout=10).text
    assert "pdserve_router_migrations_total 1.0" in metrics, "the stream ended before the kill"
    for role in ("pre", "dec2"):  # every page and state slot back
        wait_idle_slots(pd_stack[role].url)


def wait_idle_slots(url: str) -> None:
    from common.procs import wait_until

    def idle() -> bool:
        st = httpx.get(url + "/server_info", timeout=10).json()["internal_states"][0]
        slots = [ln for ln in httpx.get(url + "/metrics", timeout=10).text.splitlines()
                 if ln.startswith("pdserve_worker_state_slots_used")]
        assert slots, "no state-slot gauge on /metrics"
        return st["kv_used_tokens"] == 0 and st.get("active_rooms", 0) == 0 and \
            all(float(ln.split()[-1]) == 0 for ln in slots)

    wait_until(idle, 60, f"{url} to free its pages and state slots", 0.2)
