"""Speculative decoding on a real PD decode (separate processes, real UCX, the embedded model): the
decode speculates with n-gram proposals and its greedy tokens equal the offline engine's without
speculation (engine.engine.LLM in this process: cheaper than another service); its /server_info
and /metrics report the acceptance; a prefill without --speculative paired with it is refused with
a 412 naming the field. The test plays the router."""

from __future__ import annotations

import httpx
import pytest
from pd_harness import Pair, pd_call, start_service, wait_idle

from common.procs import stop_all

pytestmark = pytest.mark.slow

SPEC = ["--speculative", "ngram", "--num-speculative-tokens", "4"]
PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps and "
           "listening to the waves below. At the top he wiped the great lens, lit the lamp and wrote the "
           "weather in his logbook before the night fell over the harbour.")
PROMPT = f"Copy this text exactly.\n\n{PASSAGE}\n\nCopy:\n{PASSAGE[:60]}"


@pytest.fixture(scope="module")
def svc():
    procs: dict = {}
    try:
        procs["pre"], boot = start_service("prefill", *SPEC)
        procs["plain"], boot_plain = start_service("prefill")
        procs["dec"], _ = start_service("decode", *SPEC)
        ids, ref = _reference()  # while the services load
        for p in procs.values():
            p.wait_healthy(600)
        yield {"pair": Pair(procs["pre"], procs["dec"], boot),
               "mismatch": Pair(procs["plain"], procs["dec"], boot_plain), "ids": ids, "ref": ref}
    finally:
        stop_all(list(procs.values()), 10.0)  # all at once: each may take its grace
        for p in procs.values():
            p.stop()  # exited: removes its log


def _reference() -> tuple[list[int], list[int]]:
    """The prompt's ids and the offline engine's greedy 40 tokens for it, without speculation."""
    import torch

    from engine.config import EngineConfig
    from engine.engine import LLM
    from engine.sampling.params import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(EngineConfig(max_total_tokens=2048, host_kv_tokens=0, threads=1))
    ids = llm.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=40))[0]
    return ids, out.output_ids


def _body(ids: list[int], max_tokens: int = 40) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}}


def test_pd_decode_speculates_and_matches_the_engine(svc):
    _, (status, body) = pd_call(svc["pair"], "/generate", _body(svc["ids"]))
    assert status == 200 and body["output_ids"] == svc["ref"], body
    state = wait_idle(svc["pair"].decode)
    spec = state["speculative"]
    assert spec["method"] == "ngram" and spec["accepted_tokens"] > 0 and spec["mean_accepted_length"] > 1.5, spec
    metrics = httpx.get(svc["pair"].decode.url + "/metrics", timeout=10).text
    assert "pdserve_worker_spec_accepted_tokens_total" in metrics
    assert "pdserve_worker_spec_acceptance_rate" in metrics


def test_mismatched_pair_is_refused_with_412_naming_the_field(svc):
    _, (status, body) = pd_call(svc["mismatch"], "/generate", _body(svc["ids"], 8))
    assert status == 412, body
    assert "speculative" in str(body), body
    wait_idle(svc["mismatch"].decode)
