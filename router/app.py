"""The router's FastAPI app.

    POST /v1/chat/completions, /v1/completions, /generate   proxied to a prefill/decode pair (router.proxy), with
                                                            an encoder in front for images when there is one;
                                                            answered as plain ASGI (router.asgi)
    GET  /v1/models                                         from a healthy decode worker
    GET  /health        200 when at least one prefill and one decode are eligible, else 503 (encoders are optional)
    GET  /livez         200 while the process serves HTTP
    GET  /metrics       Prometheus text (router.metrics)
    GET  /openapi.json, /docs   the API (common.api_schema: the proxied endpoints' bodies and errors)
    GET  /admin/workers, POST /admin/workers {url, role (prefill|decode|encoder), bootstrap_port?},
         DELETE /admin/workers?url=
    GET  /admin/kv_index   the KV index fed by the workers' KV events, per worker (router.kv_index), and the
                           tokenizer of text and chat prompts (router.prompt_ids)
Client auth (when API keys are configured): `Authorization: Bearer <key>` on /v1/*, /generate, /admin/*.
"""

from __future__ import annotations

import logging
import math
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from common import api_schema
from common.api_requests import validate
from router import lora
from router.asgi import ProxyEndpoints, parse_json
from router.auth import authorized
from router.client import WorkerClient
from router.config import WORKER_ROLES, RouterConfig, WorkerSpec
from router.discovery_k8s import K8sDiscovery
from router.embeddings import add_embeddings_route
from router.health import HealthChecker
from router.kv_index import KVIndex, KVSubscribers
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.prefix_index import PrefixIndex
from router.prompt_ids import PromptTokenizer
from router.protocol import error_body
from router.proxy import Proxy
from router.registry import Registry, Worker
from router.sessions import add_session_routes

log = logging.getLogger("router.app")


class RouterState:
    """Everything one router process owns; built from the config, started in the app's lifespan."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.metrics = RouterMetrics()
        self.kv_index = KVIndex() if cfg.kv_events == "auto" else None  # fed by the workers' KV events
        self.kv_subs = KVSubscribers(self.kv_index) if self.kv_index is not None else None
        self.registry = Registry(cfg.health_failures, on_eject=self._ejected, on_remove=self._forget)
        for spec in cfg.workers:
            self.registry.add(spec)
        self.client = WorkerClient(cfg.internal_token, cfg.connect_timeout_s, cfg.request_timeout_s)
        policies = {
            role: make_policy(
                name,
                cfg.cache_threshold,
                cfg.balance_abs_threshold,
                cfg.balance_rel_threshold,
                PrefixIndex(cfg.cache_tree_chars),
                self.kv_index,
                predicts=role == "prefill",  # the prefill's reported cached tokens are compared
            )
            for role, name in (("prefill", cfg.prefill_policy), ("decode", cfg.decode_policy))
        }
        self.proxy = Proxy(
            self.registry,
            self.client,
            policies,
            self.metrics,
            cfg.max_retries,
            worker_wait_s=cfg.worker_wait_s,
            retry_after_s=max(1, math.ceil(cfg.health_interval_s)),
            request_log=cfg.request_log,
            migration_limit=cfg.migration_limit,
            local_prefill_queue_tokens=cfg.local_prefill_queue_tokens,
        )
        self.proxy.kv_index = self.kv_index
        # text and chat prompts tokenized for the KV index (router/prompt_ids.py): loaded at the first worker
        # with KV events, only when a role routes by cache_aware
        cache_aware = "cache_aware" in (cfg.prefill_policy, cfg.decode_policy)
        self.prompt_ids = PromptTokenizer(cfg.tokenizer) if self.kv_index is not None and cache_aware else None
        self.proxy.prompt_ids = self.prompt_ids
        self.metrics.kv_index = self.kv_index
        self.health = HealthChecker(self.registry, self.client, cfg.health_interval_s,
                                    self._server_info if self.kv_subs is not None else None)
        self.discovery = K8sDiscovery(cfg.k8s, self.registry, self.health) if cfg.k8s.enabled else None

    def _server_info(self, w: Worker, info: dict) -> None:
        """A worker's /server_info at its admission: subscribe to its KV events; the first one with events starts
        loading the tokenizer."""
        assert self.kv_subs is not None
        self.kv_subs.watch_worker(w, info)
        if self.prompt_ids is not None and isinstance(info.get("kv_events"), dict):
            self.prompt_ids.want(info)

    def _ejected(self, w: Worker) -> None:
        self.metrics.ejections.inc(role=w.role, url=w.url)
        self._forget(w)

    def _forget(self, w: Worker) -> None:
        """An ejected or removed worker's KV index entries go (re-admitted, it is subscribed again)."""
        if self.kv_subs is not None:
            self.kv_subs.drop(w.url)

    async def start(self) -> None:
        self.health.start()
        if self.discovery is not None:
            self.discovery.start()

    async def stop(self) -> None:
        if self.discovery is not None:
            await self.discovery.stop()
        await self.health.stop()
        if self.kv_subs is not None:
            await self.kv_subs.close()
        if self.prompt_ids is not None:
            await self.prompt_ids.close()
        await self.client.close()


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


async def _read_json(request: Request):
    return parse_json(await request.body())


def create_app(cfg: RouterConfig, state: RouterState | None = None) -> ProxyEndpoints:
    """The router as an ASGI app: the proxied endpoints in front of the FastAPI app (router.asgi)."""
    st = state or RouterState(cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await st.start()
        try:
            yield
        finally:
            await st.stop()

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.router = st

    @app.get("/v1/models", responses=api_schema.errors(401, 503))
    async def models(request: Request) -> Response:
        if denied := authorized(cfg, request):
            return denied
        decodes = st.registry.eligible("decode")
        if any(w.loras for w in decodes):  # LoRA: every decode's adapters in one list (router/lora.py)
            bodies = []
            for w in decodes:
                try:
                    r = await st.client.http.get(f"{w.url}/v1/models", timeout=10.0)
                    bodies += [r.json()] if r.is_success else []
                except (httpx.HTTPError, ValueError) as e:
                    log.info("GET %s/v1/models failed: %r", w.url, e)
            if bodies:
                return JSONResponse(lora.merge_models(bodies))
        for w in decodes:
            try:
                r = await st.client.http.get(f"{w.url}/v1/models", timeout=10.0)
            except httpx.HTTPError as e:
                log.info("GET %s/v1/models failed: %r", w.url, e)
                continue
            if r.is_success:
                return Response(r.content, status_code=200, media_type="application/json")
        return _error(503, "no healthy decode worker to list models")

    @app.get("/health", responses=api_schema.status_object(503, "not ready: no healthy prefill or decode worker"))
    async def health() -> Response:
        counts = {role: len(st.registry.eligible(role)) for role in WORKER_ROLES}
        ready = counts["prefill"] > 0 and counts["decode"] > 0  # encoders are optional (images then go P -> D)
        body = {"status": "ok" if ready else "unavailable", "eligible_workers": counts}
        if not ready:
            body["message"] = "need at least one healthy prefill and one healthy decode worker"
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/livez")
    async def livez() -> Response:
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse,
             responses=api_schema.plain_text("Prometheus text format 0.0.4"))
    async def metrics() -> Response:
        return PlainTextResponse(st.metrics.render(st.registry), media_type="text/plain; version=0.0.4")

    api_schema.install_http_errors(app)  # 404/405 in the error model, a 405 with its Allow
    _add_admin_routes(app, cfg, st)
    add_session_routes(app)  # refused with a 400 (PD keeps no sessions)
    add_embeddings_route(app, cfg, st)  # POST /v1/embeddings to --embeddings-pool (router/embeddings.py)
    _add_api_docs(app)
    return ProxyEndpoints(app, st)


def _add_api_docs(app: FastAPI) -> None:
    """The proxied endpoints in /openapi.json and /docs. ProxyEndpoints answers every request to these
    paths before FastAPI sees it, so these routes only document (no body is validated here)."""

    async def documented_only() -> Response:  # never reached: router.asgi.ProxyEndpoints serves the path
        return _error(500, "served by router.asgi.ProxyEndpoints")

    api_schema.install(app)
    for path in api_schema.PATHS:
        app.post(path, **api_schema.route_docs(path))(documented_only)


def _add_admin_routes(app: FastAPI, cfg: RouterConfig, st: RouterState) -> None:
    @app.get("/admin/workers", responses=api_schema.errors(401))
    async def list_workers(request: Request) -> Response:
        if denied := authorized(cfg, request):
            return denied
        return JSONResponse({"workers": [w.to_json() for w in st.registry.all()]})

    def _single_process() -> JSONResponse | None:
        if cfg.processes == 1:
            return None
        return _error(
            409,
            f"the router runs {cfg.processes} processes (--workers) and this change would reach one of "
            "them: give workers with --prefill/--decode, --config or Kubernetes discovery",
        )

    @app.post("/admin/workers", responses=api_schema.errors(400, 401, 409),
              openapi_extra=api_schema.body_docs(api_schema.AddWorkerRequest))
    async def add_worker(request: Request) -> Response:
        if denied := authorized(cfg, request) or _single_process():
            return denied
        try:
            body = await _read_json(request)
            add = validate(api_schema.AddWorkerRequest, body)
            spec = WorkerSpec(url=add.url, role=add.role, bootstrap_port=add.bootstrap_port)
        except ValueError as e:  # BadRequest and RequestInvalid are ValueErrors too
            return _error(400, str(e))
        w = st.registry.add(spec, source="admin")
        await st.health.probe(w)
        return JSONResponse(w.to_json())

    @app.get("/admin/kv_index", responses=api_schema.errors(401))
    async def kv_index(request: Request) -> Response:
        """Per worker publishing KV events: events and batches seen, blocks per medium, the last sequence,
        gaps, replays, clears, predicted vs reported cached tokens (docs/kv_events.md, "the router's index")."""
        if denied := authorized(cfg, request):
            return denied
        if st.kv_index is None:
            return JSONResponse({"enabled": False, "workers": {}})
        tok = st.prompt_ids.to_json() if st.prompt_ids is not None else None
        return JSONResponse({"enabled": True, "tokenizer": tok, **st.kv_index.to_json()})

    @app.delete("/admin/workers", responses=api_schema.errors(401, 404, 409))
    async def remove_worker(request: Request, url: str = "") -> Response:
        if denied := authorized(cfg, request) or _single_process():
            return denied
        w = st.registry.remove(url) if url else None
        if w is None:
            return _error(404, f"no worker with url {url!r}")
        return JSONResponse(w.to_json())
