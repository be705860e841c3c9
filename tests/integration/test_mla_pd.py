"""PD for an MLA model (DeepSeek-V3, random weights, 3 layers): real services, real UCX, one process per rank.
The wire page is the latent page [layers, page_size, kv_lora_rank + rope_dim]; a TP 2 decode receives one
copy of it and broadcasts it to its other rank (engine/distributed/tp_kv.py). Every answer equals the colocated TP 1
service's, greedy, through the router over a TP 1 prefill and a TP 2 decode: one prompt (exactly its latent
pages move), then two turns of a conversation, the second reusing the first's latent pages on the decode.
(TP 1 -> TP 1 PD runs in-process in tests/engine/test_deepseek.py.)
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from pd_harness import call, info, start_service
from router_harness import start_router

from common.procs import stop_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engine.test_deepseek import save_deepseek  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 10
PAGE = ["--page-size", "8"]
PATIENT = ["--heartbeat-interval", "30", "--waiting-timeout", "300", "--bootstrap-timeout", "300"]


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 250) for _ in range(n)]


def _body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}


def _ids(status_body: tuple[int, object]) -> list[int]:
    status, body = status_body
    assert status == 200, body
    return body["output_ids"]  # type: ignore[index]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory):
    """colocated TP1, prefill TP1, decode TP2, the router over the prefill and the decode."""
    model = tmp_path_factory.mktemp("mla")
    save_deepseek("deepseek_v3", model)
    common = ["--model", str(model), *PAGE, *PATIENT]
    procs: dict = {}
    try:
        procs["colo"], _ = start_service("colocated", "--model", str(model), *PAGE)
        procs["p1"], _ = start_service("prefill", *common)
        procs["d2"], _ = start_service("decode", *common, "--tp", "2")
        for p in procs.values():
            p.wait_healthy(300)
        procs["router"] = start_router(["--prefill", procs["p1"].url, "--decode", procs["d2"].url])
        procs["router"].wait_healthy(60)
        yield procs
    finally:
        stop_all(list(procs.values()), 20)
        for p in procs.values():
            p.stop()


def _colocated(stacks: dict, ids: list[int]) -> list[int]:
    return _ids(call(stacks["colo"].url, "/generate", _body(ids)))


def _routed(stacks: dict, ids: list[int]) -> list[int]:
    return _ids(call(stacks["router"].url, "/generate", _body(ids)))


def test_tp1_prefill_to_tp2_decode_through_the_router(stacks: dict) -> None:
    ids = _prompt(1, 29)
    assert _routed(stacks, ids) == _colocated(stacks, ids)
    d2 = info(stacks["d2"])
    page_bytes = 3 * 8 * (32 + 16) * 4  # layers x page_size x (kv_lora_rank + rope_dim) x fp32: the latent page
    assert d2["transfer_bytes_total"] == 4 * page_bytes, d2  # 29 tokens: 4 latent pages moved, once


def test_decode_side_reuse_of_latent_pages(stacks: dict) -> None:
    first = _prompt(2, 24)  # 3 whole pages the TP 2 decode keeps
    nxt = first + _prompt(3, 13)
    for ids in (first, nxt):
        assert _routed(stacks, ids) == _colocated(stacks, ids)
    assert info(stacks["d2"])["counters"]["kv_pages_reused_on_decode"] >= 3
