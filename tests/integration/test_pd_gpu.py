"""PD on one GPU between two processes (benchmarks/gpu_check.sh; skipped without CUDA): a prefill and a decode
service, each its own process on cuda:0, the KV pages moving over UCX from one process's device pool to the
other's (CUDA memory, no host staging when UCX has CUDA support), through the router. Every answer equals a
colocated service on the same GPU (greedy, bf16, the Triton attention backend): prompts of one page to several
hundred tokens, one at a time and a few at once, then every page and room freed on both sides.
"""

from __future__ import annotations

import concurrent.futures as cf
import random

import pytest
import torch
from pd_harness import call, info, start_service, wait_idle
from router_harness import start_router

from common.procs import stop_all

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh)")]

NEW = 12
GPU = ["--device", "cuda", "--dtype", "bfloat16", "--page-size", "16", "--max-total-tokens", "16384"]
PATIENT = ["--heartbeat-interval", "30", "--waiting-timeout", "120", "--bootstrap-timeout", "120"]


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 10_000) for _ in range(n)]


def _body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}


def _ids(status_body: tuple[int, object]) -> list[int]:
    status, body = status_body
    assert status == 200, body
    return body["output_ids"]  # type: ignore[index]


@pytest.fixture(scope="module")
def stack():
    """colocated, prefill and decode on cuda:0 (the embedded model), the router over the PD pair."""
    procs: dict = {}
    try:
        procs["colo"], _ = start_service("colocated", *GPU)
        procs["pre"], _ = start_service("prefill", *GPU, *PATIENT)
        procs["dec"], _ = start_service("decode", *GPU, *PATIENT)
        for p in procs.values():
            p.wait_healthy(300)
        procs["router"] = start_router(["--prefill", procs["pre"].url, "--decode", procs["dec"].url])
        procs["router"].wait_healthy(60)
        yield procs
    finally:
        stop_all(list(procs.values()), 20)
        for p in procs.values():
            p.stop()


def test_pd_on_one_gpu_equals_colocated(stack: dict) -> None:
    for name in ("pre", "dec", "colo"):
        state = info(stack[name])
        assert str(state["device"]).startswith("cuda") and state["attention_backend"] == "triton", (name, state)
    prompts = [_prompt(i, n) for i, n in enumerate((5, 16, 97, 400))]
    want = [_ids(call(stack["colo"].url, "/generate", _body(ids))) for ids in prompts]
    got = [_ids(call(stack["router"].url, "/generate", _body(ids))) for ids in prompts]
    assert got == want
    with cf.ThreadPoolExecutor(len(prompts)) as ex:  # a few at once: several rooms in flight
        together = list(ex.map(lambda ids: _ids(call(stack["router"].url, "/generate", _body(ids))), prompts))
    assert [len(t) for t in together] == [NEW] * len(prompts)  # (batched bf16 logits may move a near tie)
    for name in ("pre", "dec"):
        wait_idle(stack[name])
