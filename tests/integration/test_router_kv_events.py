"""The router's KV index fed by real workers' KV cache events (issue 52, docs/kv_events.md, "the router's
index"): the router (cache_aware, --kv-events auto) in front of two prefills publishing events
(--kv-events-endpoint tcp://127.0.0.1:*) and one decode, on the tiny random model, UCX over TCP loopback.

Checked: the router subscribes to both prefills from their /server_info; after a /generate with token
ids, /admin/kv_index shows the prompt's pages on the prefill that ran it; the same prompt again goes to
that prefill with its cached tokens predicted (and the worker's report counted, the metrics exported);
after /flush_cache on that prefill its blocks go to 0. A text prompt and a chat prompt (the router loads
the tokenizer the prefills report, router/prompt_ids.py): after the prefill that ran one evicted it and the
other prefill computed it (posted to that prefill and the decode directly, as a router would), the router
sends it to the one that holds it, where its approximate tree names the other.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from pd_harness import Pair, pd_call, start_service
from router_harness import Proc, start_router, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

ENV = {"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"}
PAGE = 8
EVENTS = ["--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    # the tokenizer's vocabulary: text and chat prompts are tokenized by it (the router and the frontends)
    tiny = str(make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("router_kv") / "tiny"), vocab_size=49152))
    procs: list[Proc] = []
    try:
        prefills = []
        for _ in range(2):
            p, boot = start_service("prefill", "--model", tiny, "--page-size", str(PAGE), *EVENTS, env=ENV)
            procs.append(p)
            prefills.append((p, boot))
        dec, _ = start_service("decode", "--model", tiny, "--page-size", str(PAGE), env=ENV)
        procs.append(dec)
        router = start_router([*(a for p, b in prefills for a in ("--prefill", f"{p.url},bootstrap_port={b}")),
                               "--decode", dec.url, "--prefill-policy", "cache_aware"])
        procs.append(router)  # started with the workers: its health probes admit them as they come up
        for p in procs:
            p.wait_healthy(120)
        yield router, [p for p, _ in prefills], [b for _, b in prefills], dec
    finally:
        stops = [threading.Thread(target=p.stop, args=(2.0,)) for p in procs]  # at once: each may take its grace
        for t in stops:
            t.start()
        for t in stops:
            t.join()


def _index(router: Proc) -> dict:
    r = httpx.get(router.url + "/admin/kv_index", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _generate(router: Proc, ids: list[int]) -> dict:
    r = httpx.post(router.url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_index_follows_the_prefills_events(stack) -> None:  # noqa: ANN001
    router, prefills, _, _ = stack
    urls = {p.url for p in prefills}
    body = _index(router)
    assert body["enabled"]
    wait_for(lambda: set(_index(router)["workers"]) == urls, 10, "subscriptions to both prefills")
    time.sleep(0.5)  # the SUBs' subscriptions reach the PUBs (zmq's slow joiner)
    ids = [(13 * i) % 200 + 5 for i in range(4 * PAGE + 3)]  # 4 full pages
    _generate(router, ids)

    def holder() -> str | None:
        ws = _index(router)["workers"]
        return next((u for u, w in ws.items() if w["blocks"]["GPU"] >= 4), None)

    wait_for(holder, 10, "the prompt's pages in the index")
    url = holder()
    _generate(router, ids)  # the same prompt: routed to the prefill that holds it
    wait_for(lambda: _index(router)["workers"][url]["reported_cached_tokens"] > 0, 10, "the prefill's cached tokens")
    w = _index(router)["workers"][url]
    assert w["predicted_cached_tokens"] == 4 * PAGE and w["gaps"] == 0 and w["last_seq"] >= 0, w
    metrics = httpx.get(router.url + "/metrics", timeout=10).text
    assert "pdserve_router_kv_index_predicted_cached_tokens_total 32.0" in metrics
    assert "pdserve_router_kv_index_reported_cached_tokens_total" in metrics
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    wait_for(lambda: _index(router)["workers"][url]["blocks"]["GPU"] == 0, 10, "the flushed prefill's blocks gone")


def _blocks(router: Proc) -> dict[str, int]:
    return {u: w["blocks"]["GPU"] for u, w in _index(router)["workers"].items()}


def _flushed(router: Proc, url: str) -> None:
    """/flush_cache on the worker at `url` (409 while it still holds a finished request: asked again)."""
    wait_for(lambda: httpx.post(url + "/flush_cache", timeout=30).status_code == 200, 30, f"{url} flushed", 0.2)
    wait_for(lambda: _blocks(router)[url] == 0, 30, f"{url}'s blocks gone")


TEXT = "The quick brown fox jumps over the lazy dog while the router tokenizes it exactly as the prefill does. " * 3
PROMPTS = [("/v1/completions", {"model": "m", "prompt": TEXT, "max_tokens": 2, "temperature": 0}),
           ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": TEXT}],
                                     "max_tokens": 2, "temperature": 0})]


def _follows_the_eviction(router: Proc, prefills: list[Proc], boots: list[int], dec: Proc, path: str,
                          body: dict) -> None:
    for p in prefills:
        _flushed(router, p.url)
    r = httpx.post(router.url + path, json=body, timeout=60)  # to one prefill, say X: X's tree has it
    assert r.status_code == 200, r.text
    wait_for(lambda: max(_blocks(router).values()) >= 4, 30, "the prompt's pages in the index")
    x = max(prefills, key=lambda p: _blocks(router)[p.url])
    y, y_boot = next((p, b) for p, b in zip(prefills, boots) if p is not x)
    _flushed(router, x.url)  # X evicts it ...
    (ps, pb), (ds, db) = pd_call(Pair(y, dec, y_boot), path, body)  # ... and Y computes it (not via the router)
    assert ps == 200 and ds == 200, (pb, db)
    wait_for(lambda: _blocks(router)[y.url] >= 4, 30, "Y's pages in the index")
    before = _index(router)["workers"]
    r = httpx.post(router.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    wait_for(lambda: _index(router)["workers"][y.url]["reported_cached_tokens"]
             > before[y.url]["reported_cached_tokens"], 30, f"{path}: routed to Y, which reports its hit")
    after = _index(router)["workers"]
    assert after[y.url]["predicted_cached_tokens"] - before[y.url]["predicted_cached_tokens"] >= 4 * PAGE
    assert after[x.url]["predicted_cached_tokens"] == before[x.url]["predicted_cached_tokens"]


def test_text_and_chat_prompts_follow_the_events_after_an_eviction(stack) -> None:  # noqa: ANN001
    router, prefills, boots, dec = stack
    wait_for(lambda: (_index(router)["tokenizer"] or {}).get("state") == "ready", 60,
             "the router's tokenizer, from the prefills' /server_info")
    info = httpx.get(prefills[0].url + "/server_info", timeout=10).json()
    assert _index(router)["tokenizer"]["path"] == info["tokenizer_path"]
    wait_for(lambda: len(_index(router)["workers"]) == 2, 30, "subscriptions to both prefills")
    for path, body in PROMPTS:
        _follows_the_eviction(router, prefills, boots, dec, path, body)
    assert _index(router)["tokenizer"]["tokenized"] >= 4
