"""Logprobs (issue 16, part 3): output and prompt logprobs with top-k alternatives equal a transformers
log_softmax of the same step (tiny random Llama), colocated and in PD (the first token's values
carried from the prefill in the transfer metadata, the rest from the decode); nothing is computed
for a request that did not ask."""

from __future__ import annotations

import pytest
import torch

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.forward.model_runner import ModelRunner
from engine.sampling.params import SamplingParams
from service import messages as m
from tests.pd_harness import PDPair, collect, generate_req, kv_manager
from tests.tiny_model import make_tiny_model

PROMPT = [5, 17, 42, 99, 3, 7, 11, 200, 1, 2, 3, 4, 9, 8, 7, 6, 5, 4, 30, 31, 32]  # > one 16-token chunk
SP = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
K = 5
TOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def engine_cfg(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_total_tokens=1024, host_kv_tokens=256, page_size=4,
                        chunked_prefill_size=16, max_prefill_tokens=32)


def _reference(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax [len(ids), V] over the same model: row p scores token p+1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def _gather(outs: list[m.TokenOut], rid: str = "r0") -> dict:
    got = {"ids": [], "lps": [], "tops": [], "input": None}
    for o in outs:
        if o.rid != rid:
            continue
        got["ids"] += o.new_token_ids
        got["lps"] += o.new_logprobs
        got["tops"] += o.new_top_logprobs
        if o.input_start >= 0:
            assert got["input"] is None, "prompt logprobs reported twice"
            got["input"] = (o.input_start, o.input_logprobs, o.input_top_logprobs)
    return got


def _colocated(cfg: EngineConfig, **fields) -> list[m.TokenOut]:
    runner = ModelRunner(cfg)
    role = ColocatedRole(cfg, runner, kv_manager(runner))
    outs: list[m.TokenOut] = []
    done: dict[str, m.TokenOut] = {}
    collect(role.add(generate_req("r0", PROMPT, SP, **fields)), {}, done, outs)
    while not done:
        collect(role.step(), {}, done, outs)
    return outs


def _max_diff(got: dict, ref: torch.Tensor, start: int | None) -> float:
    """The largest |ours - transformers| over chosen and top-k logprobs (output, and prompt from start)."""
    n = len(PROMPT)
    diffs = [0.0]
    for i, (t, lp) in enumerate(zip(got["ids"], got["lps"])):
        row = ref[n - 1 + i]
        diffs.append(abs(lp - float(row[t])))
        ids, lps = got["tops"][i]
        assert ids == torch.topk(row, K).indices.tolist()
        assert ids[0] == t  # greedy: the chosen token is the best alternative
        diffs += [abs(a - b) for a, b in zip(lps, torch.topk(row, K).values.tolist())]
    if start is not None:
        s, lps, tops = got["input"]
        assert s == start and len(lps) == n - max(start, 1) and len(tops) == len(lps)
        for j, lp in enumerate(lps):
            p = max(start, 1) + j  # prompt position scored by row p-1
            diffs.append(abs(lp - float(ref[p - 1, PROMPT[p]])))
            assert tops[j][0] == torch.topk(ref[p - 1], K).indices.tolist()
            diffs += [abs(a - b) for a, b in zip(tops[j][1], torch.topk(ref[p - 1], K).values.tolist())]
    return max(diffs)


@pytest.mark.parametrize("start", [0, 13])
def test_colocated_logprobs_equal_transformers(engine_cfg: EngineConfig, model_dir, start: int) -> None:
    got = _gather(_colocated(engine_cfg, return_logprob=True, top_logprobs_num=K, logprob_start_len=start))
    ref = _reference(model_dir, PROMPT + got["ids"])
    diff = _max_diff(got, ref, start)
    print(f"max |logprob - transformers| colocated start={start}: {diff:.2e}")
    assert diff < TOL


def test_no_logprobs_unless_asked(engine_cfg: EngineConfig) -> None:
    got = _gather(_colocated(engine_cfg))
    assert len(got["ids"]) == SP.max_new_tokens and not got["lps"] and not got["tops"] and got["input"] is None
    only_output = _gather(_colocated(engine_cfg, return_logprob=True))  # logprob_start_len -1: no prompt
    assert len(only_output["lps"]) == SP.max_new_tokens and not only_output["tops"]
    assert only_output["input"] is None


def test_pd_logprobs_equal_transformers(engine_cfg: EngineConfig, model_dir) -> None:
    pair = PDPair(engine_cfg)
    try:
        seen: list[m.TokenOut] = []
        tokens, d_done, p_done = pair.run([PROMPT], SP, seen=seen, fields={
            "return_logprob": True, "top_logprobs_num": K, "logprob_start_len": 0})
        assert d_done["r0"].error is None and p_done["r0"].error is None
        got = _gather(seen)
        assert got["input"] is None  # the decode computed no prompt: the prefill reports it
        assert p_done["r0"].input_start == 0
        got["input"] = (0, p_done["r0"].input_logprobs, p_done["r0"].input_top_logprobs)
        assert len(got["tops"]) == len(got["ids"]) == SP.max_new_tokens  # the first from the prefill
        ref = _reference(model_dir, PROMPT + got["ids"])
        diff = _max_diff(got, ref, 0)
        print(f"max |logprob - transformers| PD: {diff:.2e}")
        assert diff < TOL
    finally:
        pair.close()


def test_pd_prompt_prefilled_on_the_decode_reports_its_own_prompt_logprobs(engine_cfg: EngineConfig) -> None:
    """Conditional disaggregation: the decode computes the prompt, so it reports the prompt's logprobs
    and the prefill (which never computes the room) reports none: the router's join stays exact."""
    want = _gather(_colocated(engine_cfg, return_logprob=True, top_logprobs_num=K, logprob_start_len=2))
    pair = PDPair(engine_cfg, local_threshold=len(PROMPT))
    try:
        seen: list[m.TokenOut] = []
        _, d_done, p_done = pair.run([PROMPT], SP, seen=seen, fields={
            "return_logprob": True, "top_logprobs_num": K, "logprob_start_len": 2})
        assert d_done["r0"].error is None and p_done["r0"].input_start == -1
        got = _gather(seen)
        assert got["ids"] == want["ids"] and got["input"][0] == 2
        diffs = [abs(a - b) for a, b in zip(got["lps"] + got["input"][1], want["lps"] + want["input"][1])]
        assert len(diffs) == SP.max_new_tokens + len(PROMPT) - 2 and max(diffs) < TOL
    finally:
        pair.close()


def test_lm_head_rows_only_where_asked() -> None:
    """The logits each extend chunk asks the runner for (16-token chunks of a 21-token prompt)."""
    from engine.forward.batch import ExtendItem, _logit_rows
    from engine.forward.model_runner import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE
    from engine.request import KVState, LogprobState, Req
    from engine.request_groups import LogprobParams

    def rows(kv_len: int, n: int, **kw) -> tuple[int, int]:  # noqa: ANN003
        lp = LogprobState(LogprobParams(**kw))
        return _logit_rows(ExtendItem(Req("r", PROMPT, SP, kv=KVState(kv_len=kv_len), logprobs=lp), n))

    assert rows(0, 16) == (LOGITS_NONE, 0) and rows(16, 5) == (LOGITS_LAST, 0)  # not asked: the last row
    assert rows(0, 16, on=True) == (LOGITS_NONE, 0)  # output logprobs only
    assert rows(16, 5, on=True, start_len=-1) == (LOGITS_LAST, 0)
    start = {"on": True, "start_len": 13}  # rows of positions 12.. are needed
    assert rows(0, 16, **start) == (LOGITS_ALL, 12) and rows(16, 5, **start) == (LOGITS_ALL, 0)
    late = {"on": True, "start_len": 20}
    assert rows(0, 16, **late) == (LOGITS_NONE, 0) and rows(16, 5, **late) == (LOGITS_ALL, 3)
