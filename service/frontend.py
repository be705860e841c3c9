"""The HTTP side of every service (prefill, decode, colocated): one FastAPI app.

Request path:
  1. (internal token check) -> JSON body -> `service.protocol.parse_*` (400 on any bad field) on the
     parse thread (`FrontendState.parse_pool`): the event loop never tokenizes, renders a template
     or compiles a grammar; one thread keeps requests in arrival order
  2. GenerateReq -> worker over zmq (`service.launch.WorkerBridge`); the rid's queue collects TokenOuts
  3. TokenOuts -> `service.responses.RequestTracker` (incremental detokenizer, stop trimming), one per
     choice (n > 1: by TokenOut.index; a failed choice fails the request and aborts the others)
  4. one JSON body, or SSE chunks then `data: [DONE]`; a client that goes away gets its rid aborted
  5. one log line per request: rid, room, tokens, ttft, e2e; TTFT/ITL/e2e histograms

GET /health /server_info (/get_server_info) /model_info (/get_model_info) /v1/models /metrics;
POST /generate /v1/completions /v1/chat/completions /abort_request /load_lora_adapter /unload_lora_adapter.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from common import api_schema, tracing
from common.api_requests import AbortRequest
from common.http import TOKEN_HEADER, error_body
from common.tracing import TRACEPARENT
from engine.sampling.grammar import Grammars
from service import embeddings, image_prompt, images
from service.config import ServerConfig
from service.lora import AdapterTable, ModelNotFound
from service.lora_routes import lora_routes
from service.messages import AbortReq
from service.metrics import CONTENT_TYPE, FrontendMetrics
from service.protocol import (
    Limits,
    ParsedRequest,
    RequestError,
    parse_abort,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json_body,
)
from service.responses import DONE, RequestTracker, choices_body, sse, stream_chunks, usage_chunk
from service.sessions import SessionStore, add_session_routes, record_finished
from service.stats import internal_state
from service.tokenizer import PromptTooLong

log = logging.getLogger("pdserve.frontend")

MAX_BODY_BYTES = 32 << 20
PARSE_THREADS = 1
OPEN_PATHS = ("/health", "/metrics")  # probes and Prometheus scrapes carry no token
Parser = Callable[[dict[str, Any], Any, Limits], ParsedRequest]  # body, tokenizer, limits


@dataclass
class FrontendState:
    config: ServerConfig
    bridge: Any  # service.launch.WorkerBridge (or a test double with the same methods)
    tokenizer: Any  # service.tokenizer.Tokenizer
    model_dir: str
    worker_pid: int = 0
    draining: bool = False
    in_flight: int = 0
    metrics: FrontendMetrics = field(default_factory=FrontendMetrics)
    started: float = field(default_factory=time.time)
    grammars: Grammars | None = None  # structured-output grammars are compiled at parse time (built on ready)
    loras: AdapterTable = field(default_factory=AdapterTable)  # LoRA adapters and their requests (service/lora.py)
    sessions: SessionStore | None = None  # colocated: open sessions (service/sessions.py), set in create_app
    # JSON, tokenization, chat templates and grammar compiles run here, never on the event loop; one
    # thread keeps requests reaching the worker in arrival order (the tokenizer releases the GIL)
    parse_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="pdserve-parse"))
    vision: VisionInputs | None = None  # the model's image tokens and processor (None: not read yet)

    def served_name(self) -> str:
        if self.config.served_model_name:
            return self.config.served_model_name
        return self.bridge.info.get("served_model_name") or Path(self.config.engine.model).name or "model"

    def warm_grammars(self, vocab: int) -> None:
        """Start building the grammar compiler's tokenizer info (seconds) off the event loop."""
        eos = self.tokenizer.eos_token_id
        self.grammars = Grammars(self.tokenizer.path, vocab, () if eos is None else (eos,))
        self.grammars.warm()

    def limits(self) -> Limits:
        info = self.bridge.info
        ctx = int(info.get("context_length") or self.config.engine.context_length or 0)
        if not ctx:
            ctx = int(json.loads((Path(self.model_dir) / "config.json").read_text())
                      .get("max_position_embeddings", 4096))
        vocab = int(info.get("vocab_size") or self.tokenizer.vocab_size)
        if self.grammars is None or self.grammars.key[1] != vocab:  # the model's vocabulary, not the tokenizer's
            self.warm_grammars(vocab)
        self.loras.sync(info)
        if self.vision is None:
            self.vision = VisionInputs.of(self.model_dir)
        return Limits(role=self.config.role, context_length=ctx, vocab_size=vocab,
                      model_name=self.served_name(), grammars=self.grammars,
                      hidden_size=int(info.get("hidden_size") or 0), sessions=self.sessions, loras=self.loras,
                      image_tokens=self.vision.tokens)

    async def parse(self, parse: Parser, raw: bytes) -> ParsedRequest:
        """`parse` of the body `raw`, run on `parse_pool` so the loop keeps relaying other requests'
        tokens meanwhile; RequestError (400) as `parse` raises it, also for a prompt whose characters
        alone prove it cannot fit the context (refused before it is tokenized)."""
        limits = self.limits()
        tok = self.tokenizer
        if hasattr(tok, "bounded"):  # test doubles may lack it
            tok = tok.bounded(limits.context_length - 1)
        loop = asyncio.get_running_loop()
        parsed = await loop.run_in_executor(self.parse_pool, _parse_body, parse, raw, tok, limits)
        if parsed.image_urls:  # loaded, checked and preprocessed off the loop (service/images.py)
            assert self.vision is not None
            processed = await images.prepare_images(parsed.image_urls, self.vision.processor, self.config.images)
            image_prompt.expand(parsed, processed, limits)
        return parsed


@dataclass(frozen=True)
class VisionInputs:
    """A vision-language model's image token ids (config.json) and image processor (preprocessor_config.json)."""

    tokens: tuple[int, int, int] | None  # (vision start, image, vision end); None: a text-only model
    processor: Any  # service.images.ImageProcessor, or None

    @classmethod
    def of(cls, model_dir: str) -> VisionInputs:
        try:
            raw = json.loads((Path(model_dir) / "config.json").read_text())
        except (OSError, ValueError):
            return cls(None, None)
        ids = tuple(raw.get(k) for k in ("vision_start_token_id", "image_token_id", "vision_end_token_id"))
        if "vision_config" not in raw or not all(isinstance(i, int) for i in ids):
            return cls(None, None)
        return cls(ids, images.ImageProcessor.from_model_dir(model_dir))  # type: ignore[arg-type]


def _parse_body(parse: Parser, raw: bytes, tok: Any, limits: Limits) -> ParsedRequest:
    """The CPU part of a request (on the parse pool): JSON, tokenization, template, grammar compile."""
    try:
        return parse(parse_json_body(raw), tok, limits)
    except PromptTooLong as e:
        raise RequestError(str(e)) from e


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


class TokenAuth:
    """ASGI middleware: every path but /health needs header x-pdserve-token (when one is configured)."""

    def __init__(self, app: Any, token: str) -> None:
        self.app, self.token = app, token.encode()
        self.header = TOKEN_HEADER.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(self.header, b"")
            if not hmac.compare_digest(given, self.token):
                await _error("missing or wrong x-pdserve-token header", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _log_finish(trs: list[RequestTracker], status: int, endpoint: str, state: FrontendState) -> None:
    tr = trs[0]  # choice 0 times the request; tokens count every choice
    e2e = tr.e2e()
    ttft = tr.ttft()
    completion = sum(len(t.output_ids) for t in trs)
    m = state.metrics
    m.requests.inc(endpoint=endpoint, status=str(status))
    m.prompt_tokens.inc(tr.prompt_tokens)
    m.generation_tokens.inc(completion)
    if ttft is not None:
        m.ttft.observe(ttft)
    for itl in tr.itls:
        m.itl.observe(itl)
    m.e2e.observe(e2e)
    record_finished(state.sessions, tr.parsed, tr.output_ids, status)  # a session's request: its tokens
    fields = {"rid": tr.rid, "room": tr.parsed.req.pd.room, "status": status, "finish": tr.finish_reason,
              "prompt_tokens": tr.prompt_tokens, "completion_tokens": completion, "n": len(trs),
              "cached_tokens": tr.cached_tokens, "ttft": None if ttft is None else round(ttft, 4),
              "e2e": round(e2e, 4), "endpoint": endpoint}
    if tr.span is not None:
        _end_span(tr, fields)
    log.info("finished rid=%s room=%s status=%d finish=%s prompt_tokens=%d completion_tokens=%d n=%d "
             "cached_tokens=%d ttft=%s e2e=%.3f", tr.rid, tr.parsed.req.pd.room, status,
             tr.finish_reason, tr.prompt_tokens, completion, len(trs), tr.cached_tokens,
             "-" if ttft is None else f"{ttft:.3f}", e2e,
             extra={**fields, "trace_id": tracing.trace_id(tr.parsed.req.traceparent)})


def _end_span(tr: RequestTracker, fields: dict) -> None:
    tr.span.set_attributes({k: v for k, v in fields.items() if v is not None})
    if fields["status"] != 200:
        tracing.fail(tr.span, tr.error_message() if tr.failed else f"status {fields['status']}")
    tr.span.end()


async def _next_out(queue: asyncio.Queue, request: Request | None) -> Any:
    """Next TokenOut; for non-streamed requests, None once the client has gone away."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), 1.0)
        except asyncio.TimeoutError:
            if request is not None and await request.is_disconnected():
                return None


def _done(trs: list[RequestTracker]) -> bool:
    """Every choice finished, or one failed (an error ends the whole request)."""
    return all(t.finished for t in trs) or any(t.failed for t in trs)


def _failed(trs: list[RequestTracker]) -> RequestTracker | None:
    return next((t for t in trs if t.failed), None)


def _error_of(tr: RequestTracker) -> dict[str, Any]:
    """A failed request's error object: its message and status, the PD peer to blame (`fault`) and, for an
    overload refusal, `retry_after` (the router tries another worker; a client waits that long)."""
    return error_body(tr.error_message(), tr.error_status(), fault=tr.fault, retry_after=tr.retry_after)


async def _collect(state: FrontendState, trs: list[RequestTracker], queue: asyncio.Queue,
                   request: Request, endpoint: str) -> Response:
    tr = trs[0]
    try:
        while not _done(trs):
            out = await _next_out(queue, request)
            if out is None:
                state.bridge.send_soon(AbortReq(rid=tr.rid, reason="client disconnected"))
                _log_finish(trs, 499, endpoint, state)
                return _error("client disconnected", 499)
            trs[out.index].consume(out)
    finally:
        _release(state, trs)
    bad = _failed(trs)
    if bad is not None:
        if not all(t.finished for t in trs):  # n > 1: one choice failed, the others stop with it
            state.bridge.send_soon(AbortReq(rid=tr.rid, reason="another choice of the request failed"))
        _log_finish(trs, bad.error_status(), endpoint, state)
        retry = {"Retry-After": str(bad.retry_after)} if bad.retry_after > 0 else None
        return JSONResponse(_error_of(bad), status_code=bad.error_status(), headers=retry)
    _log_finish(trs, 200, endpoint, state)
    return JSONResponse(choices_body(trs))


async def _stream(state: FrontendState, trs: list[RequestTracker], queue: asyncio.Queue,
                  endpoint: str) -> AsyncIterator[bytes]:
    status = 200
    first = [True] * len(trs)
    try:
        while not _done(trs):
            out = await _next_out(queue, None)
            tr = trs[out.index]
            delta = tr.consume(out)
            if tr.failed:
                status = tr.error_status()
                yield sse(_error_of(tr))  # the status is 200 by now: an overload's retry_after is in the body only
                break
            for chunk in stream_chunks(tr, delta, first[tr.index]):
                yield chunk
            first[tr.index] = False
        if status == 200 and len(trs) > 1 and trs[0].parsed.include_usage:
            yield usage_chunk(trs)
        yield DONE
    finally:
        _end_stream(state, trs, endpoint, status)


def _release(state: FrontendState, trs: list[RequestTracker]) -> bool:
    """Drop the request's queue and in-flight count once; False if already released."""
    tr = trs[0]
    if tr.released:
        return False
    tr.released = True
    state.bridge.close(tr.rid)
    state.in_flight -= 1
    state.loras.release(tr.parsed.req.options.lora)
    return True


def _end_stream(state: FrontendState, trs: list[RequestTracker], endpoint: str, status: int) -> None:
    if not _release(state, trs):
        return
    if not all(t.finished for t in trs):  # the client went away, or a choice failed: end the others
        state.bridge.send_soon(AbortReq(rid=trs[0].rid, reason="client disconnected"))
        status = 499 if status == 200 else status
    _log_finish(trs, status, endpoint, state)


class _SSEResponse(StreamingResponse):
    """Ends the request even when the client leaves before the body generator first runs."""

    def __init__(self, body: AsyncIterator[bytes], on_end: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


async def _generate(state: FrontendState, request: Request, parse: Parser, endpoint: str) -> Response:
    t0 = time.perf_counter()
    if state.draining:
        return _error("the service is shutting down", 503)
    if not state.bridge.alive:
        return _error(f"the worker is not running: {state.bridge.dead_reason}", 503)
    if not state.bridge.ready.is_set():
        return _error("the worker is still loading the model", 503)
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        return _error(f"request body over {MAX_BODY_BYTES} bytes", 413)
    try:
        parsed = await state.parse(parse, raw)
        if parsed.kind == "chat":
            parsed.reasoning = state.config.reasoning_parser
        if state.draining:  # SIGTERM came while the request was parsed off the loop
            return _error("the service is shutting down", 503)
        queue = state.bridge.open(parsed.req.rid)
    except RequestError as e:
        state.metrics.requests.inc(endpoint=endpoint, status=str(e.status))
        if isinstance(e, ModelNotFound):  # OpenAI's model_not_found body
            return JSONResponse(e.body(), status_code=e.status)
        return _error(e.message, e.status)
    except KeyError:
        state.metrics.requests.inc(endpoint=endpoint, status="400")
        return _error("a request with this rid is already running", 400)
    state.in_flight += 1
    state.loras.acquire(parsed.req.options.lora)
    trs = [RequestTracker(parsed, state.tokenizer, t0, i) for i in range(parsed.choices)]
    tr = trs[0]
    if tracing.enabled():
        tr.span = tracing.start(f"{state.config.role}.request", request.headers.get(TRACEPARENT),
                                {"rid": parsed.req.rid, "endpoint": endpoint}, kind="server")
        parsed.req.traceparent = tracing.traceparent(tr.span)
    try:
        await state.bridge.send(parsed.req)
    except BaseException:
        _release(state, trs)
        raise
    if parsed.req.stream:
        return _SSEResponse(_stream(state, trs, queue, endpoint),
                            lambda: _end_stream(state, trs, endpoint, 499))
    return await _collect(state, trs, queue, request, endpoint)


def _info_routes(app: FastAPI, state: FrontendState) -> None:
    def health() -> JSONResponse:
        b = state.bridge
        if not b.alive:
            return JSONResponse({"status": "worker dead", "reason": b.dead_reason}, status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not b.ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503)
        state.loras.sync(b.info)  # the router prefers workers that hold a request's adapter (router/lora.py)
        return JSONResponse({"status": "ok", "role": state.config.role, "lora_adapters": sorted(state.loras.paths)})

    async def server_info() -> JSONResponse:
        stats = await state.bridge.stats(timeout=2.0)
        lim = state.limits()
        return JSONResponse({
            **state.bridge.info, "role": state.config.role, "served_model_name": state.served_name(),
            "model_path": state.model_dir, "tokenizer_path": state.tokenizer.path,
            "context_length": lim.context_length,
            "worker_pid": state.worker_pid, "worker_alive": state.bridge.alive,
            "ready": state.bridge.ready.is_set(), "draining": state.draining, "in_flight": state.in_flight,
            "uptime_s": round(time.time() - state.started, 3),
            "internal_states": [internal_state(stats.info, stats.stats)] if stats else [],
        })

    def model_info() -> JSONResponse:
        return JSONResponse({"model_path": state.model_dir, "tokenizer_path": state.tokenizer.path,
                             "served_model_name": state.served_name(), "is_generation": True,
                             "context_length": state.limits().context_length})

    def models() -> JSONResponse:
        card = {"id": state.served_name(), "object": "model", "created": int(state.started),
                "owned_by": "pdserve", "root": state.model_dir,
                "max_model_len": state.limits().context_length}
        lim = state.limits()  # syncs the adapter table
        return JSONResponse({"object": "list", "data": [card, *lim.loras.cards(int(state.started), card["id"])]})

    async def metrics() -> Response:
        stats = await state.bridge.stats(timeout=1.0)
        text = state.metrics.render(state.in_flight, state.bridge.usable, state.draining, stats)
        return Response(text, media_type=CONTENT_TYPE)

    app.get("/health", responses=api_schema.status_object(503, "starting, draining or the worker is dead"))(health)
    for path, fn in (("/server_info", server_info), ("/get_server_info", server_info),
                     ("/model_info", model_info), ("/get_model_info", model_info), ("/v1/models", models)):
        app.get(path, responses=api_schema.errors(401))(fn)
    app.get("/metrics", response_class=PlainTextResponse, responses=api_schema.plain_text(
        "Prometheus text format 0.0.4") | api_schema.errors(401))(metrics)


def create_app(state: FrontendState) -> Any:
    """The FastAPI app of one service (wrapped in the token middleware when a token is set)."""
    app = FastAPI(title=f"pdserve {state.config.role}", redoc_url=None)
    api_schema.install(app)  # /openapi.json and /docs show the models protocol.py parses the bodies with

    api_schema.install_http_errors(app)  # 404/405 in the error model, a 405 with its Allow (RFC 9110)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.message, exc.status)

    async def generate(request: Request) -> Response:
        return await _generate(state, request, parse_generate, "generate")

    async def completions(request: Request) -> Response:
        return await _generate(state, request, parse_completion, "completions")

    async def chat(request: Request) -> Response:
        return await _generate(state, request, parse_chat, "chat")

    async def abort_request(request: Request) -> Response:
        if not state.bridge.usable:
            return _error("the worker is not running", 503)
        req = parse_abort(parse_json_body(await request.body()))
        await state.bridge.send(req)
        log.info("abort rid=%s room=%s all=%s", req.rid or None, req.room, req.abort_all)
        return JSONResponse({"success": True})

    async def flush_cache() -> Response:
        """Empty the worker's prefix cache; 409 while requests are in flight (SGLang's endpoint)."""
        out = await state.bridge.flush_cache()
        if out is None:
            return _error("the worker is not running or did not answer", 503)
        if not out.ok:
            return _error(out.message, 409)
        log.info("flush_cache: %d tokens freed", out.freed_tokens)
        return JSONResponse({"success": True, "message": out.message, "freed_tokens": out.freed_tokens})

    for path, fn in (("/generate", generate), ("/v1/completions", completions), ("/v1/chat/completions", chat)):
        app.post(path, **api_schema.route_docs(path))(fn)
    app.post("/abort_request", responses=api_schema.errors(400, 401, 503),
             openapi_extra=api_schema.body_docs(AbortRequest))(abort_request)
    app.post("/flush_cache", responses=api_schema.errors(401, 409, 503))(flush_cache)
    if state.config.role == "colocated" and state.sessions is None:
        state.sessions = SessionStore(state.config.engine.session_timeout_s)
    add_session_routes(app, state)  # POST /open_session, /close_session
    _info_routes(app, state)
    embeddings.add_route(app, state)  # POST /v1/embeddings (service/embeddings.py)
    lora_routes(app, state)
    if state.config.internal_token:
        return TokenAuth(app, state.config.internal_token)
    return app
