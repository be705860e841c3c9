"""The router's KV index fed by real workers' KV cache events (issue 52, docs/kv_events.md, "the router's
index"): the router (cache_aware, --kv-events auto) in front of two prefills publishing events
(--kv-events-endpoint tcp://127.0.0.1:*) and one decode, on the tiny random model, UCX over TCP loopback.

Checked: the router subscribes to both prefills from their /server_info; after a /generate with token
ids, /admin/kv_index shows the prompt's pages on the prefill that ran it; the same prompt again goes to
that prefill with its cached tokens predicted (and the worker's report counted, the metrics exported);
after /flush_cache on that prefill its blocks go to 0.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from pd_harness import start_service
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
    tiny = str(make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("router_kv") / "tiny")))
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
        yield router, [p for p, _ in prefills]
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
    router, prefills = stack
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
