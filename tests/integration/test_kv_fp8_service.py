"""The FP8 KV cache served (issue 49 part 4): a prefill and a decode with `--kv-cache-dtype fp8_e4m3`
behind the router, UCX over TCP loopback, give the offline engine's greedy tokens with the same KV dtype;
a decode whose KV dtype differs from its prefill's answers 412 naming the field (the test plays the
router for that pair) and keeps nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from pd_harness import Pair, pd_call, start_service, wait_idle
from router_harness import start_router

from common.procs import stop_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

ENV = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]
IDS = [(7 * i + 3) % 250 + 1 for i in range(37)]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory):
    model = str(make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("fp8_service") / "tiny")))
    common = ["--model", model, "--page-size", "4"]
    procs: dict = {}
    try:
        procs["pre"], boot = start_service("prefill", *common, *FP8, env=ENV)
        procs["dec"], _ = start_service("decode", *common, *FP8, env=ENV)
        procs["plain"], _ = start_service("decode", *common, env=ENV)
        procs["router"] = start_router(["--prefill", f"{procs['pre'].url},bootstrap_port={boot}",
                                        "--decode", procs["dec"].url])
        ref = _reference(model)  # while the services load
        for p in procs.values():
            p.wait_healthy(300)
        yield {**procs, "mismatch": Pair(procs["pre"], procs["plain"], boot), "ref": ref}
    finally:
        stop_all(list(procs.values()), 10.0)  # all at once: each may take its grace
        for p in procs.values():
            p.stop()


def _reference(model: str) -> list[int]:
    from engine.config import EngineConfig
    from engine.engine import LLM
    from engine.sampling.params import SamplingParams

    llm = LLM(EngineConfig(model=model, page_size=4, max_total_tokens=512, threads=1, kv_cache_dtype="fp8_e4m3"))
    return llm.generate([IDS], SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))[0].output_ids


def _body(max_tokens: int = 12) -> dict:
    return {"input_ids": IDS, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True}}


def test_fp8_pair_through_the_router_gives_the_engines_tokens(svc) -> None:  # noqa: ANN001
    info = httpx.get(svc["dec"].url + "/server_info", timeout=10).json()
    assert info["kv_cache_dtype"] == "fp8_e4m3"
    r = httpx.post(svc["router"].url + "/generate", json=_body(), timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == svc["ref"]


def test_a_decode_of_another_kv_dtype_answers_412_naming_the_field(svc) -> None:  # noqa: ANN001
    _, (status, body) = pd_call(svc["mismatch"], "/generate", _body(4))
    assert status == 412, body
    assert "kv_cache_dtype" in str(body) and "fp8_e4m3" in str(body), body
    wait_idle(svc["plain"])
