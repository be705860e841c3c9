"""The router's POST /v1/embeddings (router/embeddings.py) in front of workers that fail: in-process
httpx MockTransport handlers, no HTTP. A worker that never answers costs one --request-timeout per
attempt, then the next worker of the pool is tried; every attempt timed out -> 504, unreachable -> 503."""

from __future__ import annotations

import httpx
from starlette.testclient import TestClient

from router.app import RouterState, create_app
from router.client import WorkerClient
from router.config import RouterConfig, WorkerSpec


def _router(handler, *, retries: int = 1) -> tuple[TestClient, RouterState]:  # noqa: ANN001
    cfg = RouterConfig(workers=(WorkerSpec("http://p0:1", "prefill", bootstrap_port=9000),
                                WorkerSpec("http://p1:1", "prefill", bootstrap_port=9001),
                                WorkerSpec("http://d0:1", "decode")), max_retries=retries)
    st = RouterState(cfg)
    st.client = WorkerClient(None, 1.0, 5.0, http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    for w in st.registry.all():
        st.registry.record_success(w)
    return TestClient(create_app(cfg, st)), st  # no lifespan: no probes


def test_embeddings_relay_time_out_and_unreachable_workers() -> None:
    seen: list[str] = []

    def hang(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        raise httpx.ReadTimeout("no answer", request=request)

    client, st = _router(hang)
    r = client.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 504 and "timed out" in r.json()["error"]["message"], r.text
    assert sorted(seen) == ["p0", "p1"]  # each prefill once, never the decode
    assert all(w.consecutive_failures == 1 for w in st.registry.all("prefill"))

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    r = _router(refuse)[0].post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 503 and "/v1/embeddings" in r.json()["error"]["message"]

    body = {"object": "list", "model": "m", "data": [], "usage": {"prompt_tokens": 1, "total_tokens": 1}}
    ok = _router(lambda request: httpx.Response(200, json=body))[0].post("/v1/embeddings", json={"input": "hi"})
    assert ok.status_code == 200 and ok.json() == body
