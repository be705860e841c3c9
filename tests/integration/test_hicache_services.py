"""HiCache through real services (issue 39): a colocated service and a prefill/decode pair (real UCX; the
prefill at --tp 2, its host tier's stores and loads run on both ranks: issue 51), each with a host tier (the
colocated one also a disk tier) over a KV pool far smaller than the conversations' KV, on the tiny
random-weight model with the embedded tokenizer.

Checked: multi-turn greedy outputs equal the same prompts computed from scratch (after /flush_cache)
and the PD pair's equal the colocated service's; host (and disk) hits show in cached_tokens,
/server_info and /metrics; the decode's prefix reuse counts host-tier hits; /flush_cache empties
every tier; kill -9 of a service mid-traffic leaks nothing (after a restart on the same
--hicache-dir its tiers start empty and it serves the same tokens).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import sys
from pathlib import Path

import httpx
import pytest
from pd_harness import Pair, call, info, pd_call, start_service, wait_idle
from router_harness import Proc

from common.procs import stop_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

POOL = ["--page-size", "8", "--max-total-tokens", "128", "--new-token-ratio", "0"]
PATIENT = ["--heartbeat-interval", "30", "--waiting-timeout", "300", "--bootstrap-timeout", "300"]
CONVS, TURNS, NEW = 6, 3, 8


def _body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}


def _out(status_body: tuple[int, object]) -> tuple[list[int], int]:
    status, body = status_body
    assert status == 200, body
    return body["output_ids"], body["meta_info"]["cached_tokens"]  # type: ignore[index]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hicache")
    model = str(make_tiny_model(make_tokenizer_dir(root / "m")))
    disk = str(root / "disk")
    tier = ["--hicache-host-tokens", "256"]
    procs: dict = {}
    try:
        procs["colo"], _ = start_service("colocated", "--model", model, *POOL, *tier, "--hicache-dir", disk,
                                         "--hicache-disk-bytes", str(1 << 20))
        procs["pre"], boot = start_service("prefill", "--model", model, *POOL, *tier, *PATIENT, "--tp", "2")
        procs["dec"], _ = start_service("decode", "--model", model, *POOL, *tier, *PATIENT,
                                        "--local-prefill-threshold", "0")
        for p in procs.values():
            p.wait_healthy(300)
        yield {"colo": procs["colo"], "pair": Pair(procs["pre"], procs["dec"], boot), "disk": disk, "procs": procs}
    finally:
        stop_all(list(procs.values()), 20)  # all at once: each drains in parallel
        for p in procs.values():
            p.stop()  # gone already: removes its log


def _chat(send) -> tuple[list[list[int]], list[list[int]], list[int]]:  # noqa: ANN001
    """CONVS conversations, round robin by turn; returns (prompts, outputs, cached tokens) per request."""
    history = [[(17 * c + i) % 240 + 5 for i in range(30)] for c in range(CONVS)]
    prompts, outs, cached = [], [], []
    for t in range(TURNS):
        for c in range(CONVS):
            prompt = history[c] + [(7 * c + 3 * t + i) % 240 + 5 for i in range(5)]
            out, hit = send(prompt)
            prompts.append(prompt)
            outs.append(out)
            cached.append(hit)
            history[c] = prompt + out
    return prompts, outs, cached


@pytest.fixture(scope="module")
def colo_run(stack):
    colo = stack["colo"]
    run = _chat(lambda ids: _out(call(colo.url, "/generate", _body(ids))))
    state = wait_idle(colo)
    return run, state


def test_colocated_host_and_disk_hits_and_greedy_unchanged(stack, colo_run) -> None:
    (prompts, outs, cached), state = colo_run
    tiers = state["hicache"]
    assert tiers["hit_tokens"]["host"] > 0 and tiers["loaded_bytes"]["host"] > 0
    assert tiers["evictions"]["device"] > 0 and tiers["evictions"]["host"] > 0
    assert sum(cached[CONVS:]) >= tiers["hit_tokens"]["host"] // 2  # later turns reuse their histories
    metrics = httpx.get(stack["colo"].url + "/metrics", timeout=10).text
    assert 'pdserve_worker_hicache_hit_tokens_total{name="host"}' in metrics
    assert 'pdserve_worker_hicache_bytes_in_use{name="disk"}' in metrics
    # the same prompts from scratch: flush every tier before each
    for p, o in list(zip(prompts, outs))[-CONVS:]:
        assert httpx.post(stack["colo"].url + "/flush_cache", timeout=30).status_code == 200
        got, hit = _out(call(stack["colo"].url, "/generate", _body(p)))
        assert hit == 0 and got == o


def test_pd_pair_reuses_host_tier_on_both_sides(stack, colo_run) -> None:
    pair: Pair = stack["pair"]
    (prompts, outs, _), _ = colo_run
    run = _chat(lambda ids: _out(pd_call(pair, "/generate", _body(ids))[1]))
    assert run[1] == outs  # PD with tiers (the prefill at TP 2) == colocated with tiers == from scratch
    pre, dec = wait_idle(pair.prefill), wait_idle(pair.decode)
    assert pre["hicache"]["hit_tokens"]["host"] > 0
    assert dec["hicache"]["hit_tokens"]["host"] > 0  # the decode loaded them and named them to the prefill
    assert dec["counters"]["kv_pages_reused_on_decode"] > 0


def test_flush_cache_empties_every_tier(stack, colo_run) -> None:
    for proc in (stack["colo"], stack["pair"].prefill, stack["pair"].decode):
        r = httpx.post(proc.url + "/flush_cache", timeout=30)
        assert r.status_code == 200, r.text
        tiers = info(proc)["hicache"]
        assert all(v == 0 for v in tiers["bytes_in_use"].values()), tiers
    kv_files = [f for d, _, fs in os.walk(stack["disk"]) for f in fs if f.endswith(".kv")]
    assert kv_files == []


def test_kill9_mid_traffic_leaks_nothing(stack, colo_run) -> None:
    colo: Proc = stack["colo"]
    (prompts, outs, _), _ = colo_run
    for p in prompts[CONVS : 2 * CONVS]:  # turn 2 again: the pool evicts these histories to the tiers
        _out(call(colo.url, "/generate", _body(p)))
    assert info(colo)["hicache"]["bytes_in_use"]["host"] > 0
    with cf.ThreadPoolExecutor(4) as ex:  # turn 3: each loads its history from the host or disk tier
        futs = [ex.submit(call, colo.url, "/generate", _body(p), 30) for p in prompts[2 * CONVS :]]
        futs[0].result()
        colo.signal(signal.SIGKILL, group=True)
        for f in futs:
            try:
                f.result()
            except httpx.HTTPError:
                pass
    colo.popen.wait(30)
    again = Proc(colo.name, colo.args, colo.url)
    stack["procs"]["colo"] = again  # the fixture stops it
    again.wait_healthy(300)
    state = info(again)
    assert state["kv_used_tokens"] == 0 and state.get("host_kv_used_pages", 0) == 0
    assert all(v == 0 for v in state["hicache"]["bytes_in_use"].values())
    got, _ = _out(call(again.url, "/generate", _body(prompts[-1])))
    assert got == outs[-1]
