"""`POST /v1/embeddings` through the router: the body goes untouched to the least loaded healthy
worker of `--embeddings-pool` (prefill by default: an embedding is a forward without generation),
whose answer (JSON, any status) is relayed as is. A worker that cannot be reached or does not answer
within --request-timeout is marked failed and the next one of the pool is tried, up to --max-retries
more times; then 504 when every attempt timed out, else 503 (none healthy or reachable). The OpenAPI
document shows the body the services validate (common/api_embeddings.py), not checked here."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from common import api_embeddings
from router.auth import authorized
from router.protocol import error_body

log = logging.getLogger("router.embeddings")


def add_embeddings_route(app: FastAPI, cfg: Any, st: Any) -> None:
    """The route on the router's FastAPI app (`cfg`: RouterConfig, `st`: router.app.RouterState)."""
    @app.post("/v1/embeddings", **api_embeddings.route_docs(400, 401, 500, 503, 504))
    async def embeddings(request: Request) -> Response:
        if denied := authorized(cfg, request):
            return denied
        body = await request.body()
        tried: set[str] = set()
        timeouts = 0
        for _ in range(cfg.max_retries + 1):
            pool = [w for w in st.registry.eligible(cfg.embeddings_pool) if w.url not in tried]
            if not pool:
                break
            w = min(pool, key=lambda w: (w.outstanding_requests, w.outstanding_tokens))
            tried.add(w.url)
            lease = st.registry.lease(w, 0)
            try:
                r = await st.client.http.post(f"{w.url}/v1/embeddings", content=body,
                                              headers={"content-type": "application/json"})
            except httpx.HTTPError as e:
                log.info("POST %s/v1/embeddings failed: %r", w.url, e)
                timeouts += isinstance(e, httpx.TimeoutException)
                st.registry.record_failure(w, f"/v1/embeddings: {e!r}")
                continue
            finally:
                lease.release()
            return Response(r.content, status_code=r.status_code, media_type="application/json")
        if tried and timeouts == len(tried):
            message = f"every attempt at /v1/embeddings timed out ({len(tried)} {cfg.embeddings_pool} worker(s))"
            return JSONResponse(error_body(message, 504), status_code=504)
        message = f"no healthy {cfg.embeddings_pool} worker answered /v1/embeddings"
        return JSONResponse(error_body(message, 503), status_code=503)
