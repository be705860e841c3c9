"""Speculative decoding (engine/extras/speculative) on tiny random-weight models, colocated and in-process PD.

Two tiny models: `random` (a random Llama: its text rarely repeats, so drafts are mostly rejected)
and `copier` (the same architecture with a bigram LM head that follows a 40-token cycle, the
layers' outputs scaled down so context still moves some argmaxes: drafts from the cycle are accepted
often but not always). Exactness: the tokens with speculation equal those without, greedy and seeded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.extras.speculative import ngram
from engine.extras.speculative.config import SpecConfig
from engine.extras.speculative.policy import SwitchOff
from engine.extras.speculative.stats import SpecStats
from engine.extras.speculative.verify import rejection_step
from engine.forward.model_runner import ModelRunner
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.memory import HostKVPool, KVPool
from engine.request import Req
from engine.sampling.params import SamplingParams
from service import messages as m
from tests.pd_harness import PDPair, collect, generate_req, kv_manager
from tests.tiny_model import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11, frequency_penalty=0.4,
                        logit_bias=((3, 1.5),), max_new_tokens=30, ignore_eos=True)
NGRAM = SpecConfig(speculative="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)


def make_copier(dst: Path, scale: float = 0.06) -> tuple[str, list[int]]:
    """A tiny model whose greedy text mostly follows a 40-token cycle (returned): an untied LM head
    maps each token's embedding to its successor's row; attention and MLP outputs scaled by `scale`."""
    d = make_tiny_model(dst, tie_word_embeddings=False)
    t = load_file(str(d / "model.safetensors"))
    order = torch.randperm(256, generator=torch.Generator().manual_seed(1)).tolist()
    cycle, rest = order[:40], order[40:]
    succ = torch.zeros(256, dtype=torch.long)
    for ring in (cycle, rest):
        for a, b in zip(ring, ring[1:] + ring[:1]):
            succ[a] = b
    lm = torch.zeros_like(t["model.embed_tokens.weight"])
    lm[succ] = t["model.embed_tokens.weight"]
    t["lm_head.weight"] = lm
    for k in t:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            t[k] = t[k] * scale
    save_file(t, str(d / "model.safetensors"))
    return str(d), cycle


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    torch.set_num_threads(1)
    copier, cycle = make_copier(tmp_path_factory.mktemp("copier"))
    rnd = str(make_tiny_model(tmp_path_factory.mktemp("random")))
    gen = torch.Generator().manual_seed(3)
    return {"copier": copier, "random": rnd,
            "often": cycle * 2 + cycle[:7],  # the cycle twice: the model continues it
            "rarely": torch.randint(0, 250, (45,), generator=gen).tolist()}


def _cfg(model: str, spec: SpecConfig | None = None, **kw: object) -> EngineConfig:
    base = dict(model=model, max_total_tokens=2048, host_kv_tokens=1024, page_size=4, chunked_prefill_size=64,
                max_prefill_tokens=128, threads=1, spec=spec or SpecConfig())
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def run(cfg: EngineConfig, prompts: list[list[int]], sp: SamplingParams | list[SamplingParams], n: int = 1,
        logprobs: dict[str, list[float]] | None = None, runner: object = None,
        ) -> tuple[dict[str, list[int]], dict[str, m.TokenOut], ColocatedRole]:
    """Serve the prompts colocated (rids r0, r1, ...; with `logprobs`, each token's is collected
    there) on `runner` (default: a ModelRunner of cfg); every page freed after."""
    runner = runner or ModelRunner(cfg)
    kv = kv_manager(runner, cfg.prefix_cache)
    role = ColocatedRole(cfg, runner, kv)
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    seen: list[m.TokenOut] = []
    for i, ids in enumerate(prompts):
        p = sp[i] if isinstance(sp, list) else sp
        msg = generate_req(f"r{i}", ids, p, n=n, return_logprob=logprobs is not None)
        collect(role.add(msg), tokens, done, seen)
    while len(done) < len(prompts) * n:
        collect(role.step(), tokens, done, seen)
    for o in seen if logprobs is not None else []:
        logprobs.setdefault(f"{o.rid}#{o.index}" if o.index else o.rid, []).extend(o.new_logprobs)
    assert all(o.error is None for o in done.values()), [o.error for o in done.values()]
    kv.flush()
    assert kv.all_free() and kv.used_tokens == 0
    return tokens, done, role


# ---- pure parts -------------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match() -> None:
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram.propose(toks, 2, 2, 3) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8
    assert ngram.propose(toks, 5, 2, 3) == [7, 8, 1, 2, 3]
    assert ngram.propose([5, 6, 7], 3, 1, 2) == []  # no earlier match
    assert ngram.propose([4, 4], 3, 1, 1) == [4]  # a match must leave a token after it
    assert ngram.propose(toks, 0, 1, 3) == []


def test_config_names_the_flag() -> None:
    for kw, flag in [({"speculative": "eagle"}, "--speculative"), ({"num_speculative_tokens": 0},
                     "--num-speculative-tokens"), ({"ngram_min": 3, "ngram_max": 2}, "--ngram-min"),
                     ({"speculative": "draft"}, "--draft-model"),
                     ({"speculative": "ngram", "speculative_min_acceptance": 2.0}, "--speculative-min-acceptance")]:
        with pytest.raises(ValueError, match=flag):
            SpecConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_rule_keeps_the_target_distribution(point_mass: bool) -> None:
    """Over a 6-token vocabulary, 10,000 draws of (draft x ~ q, then the rule) give tokens distributed
    as p: every frequency within 0.02 of p (over 4 standard errors; fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03])
    q = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.05, 0.1])
    trials, counts = 10_000, torch.zeros(6)
    for _ in range(trials):
        x = int(torch.multinomial(q, 1, generator=gen))
        qq = torch.nn.functional.one_hot(torch.tensor(x), 6).float() if point_mass else q
        tok, ok = rejection_step(p, qq, x, gen)
        assert ok == (tok == x)
        counts[tok] += 1
    assert torch.allclose(counts / trials, p, atol=0.02), (counts / trials).tolist()


def test_switch_off_pauses_a_request_and_the_batch() -> None:
    cfg = SpecConfig(speculative="ngram", speculative_min_acceptance=0.5, speculative_max_batch=2)
    pol = SwitchOff(cfg, context_length=512)
    r = Req(rid="a", token_ids=list(range(10)), sampling=SamplingParams(max_new_tokens=100))
    assert pol.draft_len(r) == 4 and pol.batch_on(2) and not pol.batch_on(3)
    assert not pol.record(r, 4, 1)  # rate 0.625: still on
    assert pol.record(r, 4, 0)  # 0.3125 < 0.5: pauses 4 steps
    assert [pol.draft_len(r) for _ in range(5)] == [0, 0, 0, 0, 4]
    assert pol.record(r, 4, 0) and r.spec.skip == 8  # the next pause is twice as long
    grammar = Req(rid="g", token_ids=[1], sampling=SamplingParams(regex="a+"))
    assert pol.draft_len(grammar) == 0  # structured output never speculates
    short = Req(rid="s", token_ids=[1, 2], num_prompt_tokens=1, sampling=SamplingParams(max_new_tokens=3))
    assert pol.draft_len(short) == 1  # the verify never emits past max_new_tokens


def test_rollback_frees_whole_pages_past_kv_len() -> None:
    pool = KVPool(num_pages=9, num_layers=1, page_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                  device="cpu")
    kv = KVManager(pool, HostKVPool(0, tuple(pool.buffer.shape[1:]), torch.float32, pin=False))
    r = Req(rid="a", token_ids=list(range(6)), sampling=SamplingParams())
    r.kv.kv_len = 5
    kv.grow(r, 1 + 8)  # a verify of 9 positions: 14 tokens, 4 pages
    assert len(r.kv.pages) == 4
    r.kv.kv_len = 7  # two drafts accepted
    assert kv.rollback(r) == 2 and len(r.kv.pages) == 2 and pool.allocator.num_used == 2
    kv.release(r)
    assert kv.all_free()


# ---- colocated exactness ------------------------------------------------------------------------
def test_greedy_identical_and_accepts_often_on_repetition(models: dict) -> None:
    prompts = [models["often"], models["rarely"]]
    ref, _, _ = run(_cfg(models["copier"]), prompts, GREEDY)
    out, done, role = run(_cfg(models["copier"], NGRAM), prompts, GREEDY)
    assert out == ref and all(len(v) == GREEDY.max_new_tokens for v in out.values())
    s: SpecStats = role.sched.stats().spec
    assert s.method == "ngram" and s.proposed_tokens > 0
    assert s.acceptance_rate > 0.4 and s.mean_accepted_length > 2.0, s
    forward = role.sched.exec.forward_tokens
    assert forward < sum(len(p) for p in prompts) + 2 * GREEDY.max_new_tokens + s.proposed_tokens


def test_greedy_identical_when_drafts_are_rejected(models: dict) -> None:
    prompts = [models["rarely"], models["often"][:30]]
    ref, _, _ = run(_cfg(models["random"]), prompts, GREEDY)
    out, _, role = run(_cfg(models["random"], NGRAM), prompts, GREEDY)
    assert out == ref
    s = role.sched.stats().spec
    assert s.acceptance_rate < 0.5 and s.switched_off > 0, s  # rejected drafts pause the requests


def test_stops_n_and_logprobs_inside_accepted_runs(models: dict) -> None:
    """max_tokens and a stop token that end a request inside an accepted run, n > 1, and logprobs of
    the emitted tokens: all as without speculation."""
    cyc = models["often"]
    stop_tok = cyc[(len(cyc) + 9) % 40]  # the model's 10th token: inside a run of accepted drafts
    sps = [SamplingParams(temperature=0.0, max_new_tokens=7, ignore_eos=True),
           SamplingParams(temperature=0.0, max_new_tokens=30, stop_token_ids=(stop_tok,), ignore_eos=True)]
    prompts = [cyc, cyc]
    ref_lp: dict[str, list[float]] = {}
    lp: dict[str, list[float]] = {}
    ref, rdone, _ = run(_cfg(models["copier"]), prompts, sps, n=2, logprobs=ref_lp)
    out, done, role = run(_cfg(models["copier"], NGRAM), prompts, sps, n=2, logprobs=lp)
    assert out == ref and len(out["r0"]) == 7 and len(out) == 4
    assert lp.keys() == ref_lp.keys() and all(len(lp[k]) == len(out[k]) for k in lp)
    assert all(torch.allclose(torch.tensor(lp[k]), torch.tensor(ref_lp[k]), atol=1e-4) for k in lp)
    assert done["r1"].finish_reason == rdone["r1"].finish_reason == "stop" and len(out["r1"]) < 30
    assert role.sched.stats().spec.accepted_tokens > 0


def test_seeded_sampling_same_text_and_logprobs(models: dict) -> None:
    """n-gram drafts at temperature > 0 (with penalties, logit_bias, top-k/p): the rule samples each
    position as the target would (position-keyed seed), so the text equals the unspeculated one."""
    prompts = [models["often"], models["rarely"]]
    cfg = _cfg(models["copier"])
    ref, _, _ = run(cfg, prompts, SEEDED, n=2)
    out, _, _ = run(_cfg(models["copier"], NGRAM), prompts, SEEDED, n=2)
    assert out == ref


def test_retraction_mid_request_and_mixed_batch(models: dict) -> None:
    """A pool too small for every request retracts some mid-request (drafts are dropped first); a
    batch over --speculative-max-batch speculates for nobody; the tokens stay those of a big pool."""
    prompts = [models["often"][i:] for i in range(0, 36, 6)]
    ref, _, _ = run(_cfg(models["copier"]), prompts, GREEDY)
    spec = SpecConfig(speculative="ngram", ngram_min=1, speculative_max_batch=3)
    small = _cfg(models["copier"], spec, max_total_tokens=320, new_token_ratio=0.0)
    out, _, role = run(small, prompts, GREEDY)
    assert out == ref
    st = role.sched.stats()
    assert st.retractions > 0 and st.reloads == st.retractions
    assert st.spec.batch_off_steps > 0 and st.spec.accepted_tokens > 0


# ---- PD ---------------------------------------------------------------------------------------
def test_pd_decode_speculates_and_matches_colocated(models: dict) -> None:
    cfg = _cfg(models["copier"], NGRAM, prefix_cache=True)
    prompts = [models["often"], models["rarely"]]
    ref, _, _ = run(_cfg(models["copier"]), prompts, GREEDY)
    pair = PDPair(cfg)
    try:
        tokens, done, _ = pair.run(prompts, GREEDY)
        assert tokens == ref and all(o.error is None for o in done.values())
        assert pair.decode.sched.stats().spec.accepted_tokens > 0
        assert pair.d_kv.all_free()
    finally:
        pair.close()


def test_pd_mismatched_speculative_config_is_refused_with_412(models: dict) -> None:
    cfg = _cfg(models["random"])
    pair = PDPair(cfg, decode_cfg=_cfg(models["random"], NGRAM))
    try:
        _, done, _ = pair.run([models["rarely"]], GREEDY, timeout_s=30)
        o = done["r0"]
        assert o.error_code == 412 and "speculative" in (o.error or ""), (o.error_code, o.error)
        assert pair.d_kv.all_free() and pair.p_kv.all_free()
    finally:
        pair.close()


# ---- draft model ------------------------------------------------------------------------------
def test_draft_model_greedy_identical(models: dict) -> None:
    """A tiny random draft (rarely right) and the target itself as its own draft (always right, up to
    rounding): greedy tokens equal the unspeculated ones; the draft pool drains to 0 with the target's."""
    prompts = [models["often"], models["rarely"]]
    ref, _, _ = run(_cfg(models["copier"]), prompts, GREEDY, n=2)
    rates = []
    for draft in (models["random"], models["copier"]):
        spec = SpecConfig(speculative="draft", draft_model=draft, num_speculative_tokens=3,
                          speculative_min_acceptance=0.0)
        out, _, role = run(_cfg(models["copier"], spec, chunked_prefill_size=32), prompts, GREEDY, n=2)
        assert out == ref
        assert role.sched.spec.draft.used_pages() == 0  # type: ignore[union-attr]
        rates.append(role.sched.stats().spec.acceptance_rate)
    assert rates[0] < 0.5 < 0.9 < rates[1], rates


@pytest.mark.slow
def test_draft_model_under_tp2_greedy_identical(models: dict) -> None:
    """--speculative draft at --tp 2: the target's ranks verify, the draft runs whole on rank 0 (its own
    pool and runner, no rank op); greedy tokens equal the unspeculated TP 1 ones, the drafts are accepted
    (the target as its own draft), and the draft pool drains."""
    from tests.tp_spawn import tp_runner

    prompts = [models["often"], models["rarely"]]
    ref, _, _ = run(_cfg(models["copier"]), prompts, GREEDY, n=2)
    spec = SpecConfig(speculative="draft", draft_model=models["copier"], num_speculative_tokens=3,
                      speculative_min_acceptance=0.0)
    with tp_runner(_cfg(models["copier"], spec, chunked_prefill_size=32)) as runner:
        out, _, role = run(runner.cfg, prompts, GREEDY, n=2, runner=runner)
        assert runner.cfg.tp == 2
        assert out == ref
        assert role.sched.spec.draft.used_pages() == 0  # type: ignore[union-attr]
        assert role.sched.stats().spec.acceptance_rate > 0.9
        role.close()


def test_draft_model_sampling_reproducible(models: dict) -> None:
    """Sampling with a draft uses the rejection rule (its distribution: the statistical test above);
    the text is a function of the seed alone, and every page is freed."""
    spec = SpecConfig(speculative="draft", draft_model=models["copier"], num_speculative_tokens=3)
    prompts = [models["often"]]
    a, _, role = run(_cfg(models["copier"], spec), prompts, SEEDED)
    b, _, _ = run(_cfg(models["copier"], spec), prompts, SEEDED)
    assert a == b and len(a["r0"]) == SEEDED.max_new_tokens
    assert role.sched.stats().spec.accepted_tokens > 0
    assert role.sched.spec.draft.used_pages() == 0  # type: ignore[union-attr]


def test_draft_vocab_mismatch_names_the_flag(models: dict, tmp_path: Path) -> None:
    other = str(make_tiny_model(tmp_path / "v512", vocab_size=512))
    spec = SpecConfig(speculative="draft", draft_model=other)
    with pytest.raises(ValueError, match="--draft-model"):
        run(_cfg(models["copier"], spec), [[1, 2, 3]], GREEDY)
