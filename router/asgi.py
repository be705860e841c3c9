"""The proxied endpoints as plain ASGI, in front of the FastAPI app that serves everything else.

`POST /v1/chat/completions`, `/v1/completions`, `/generate` are the router's hot path: FastAPI's
middleware layers, request objects, routing and StreamingResponse cost more per request than the
proxying itself, so `ProxyEndpoints` (the ASGI app uvicorn serves) answers these three paths from the
raw ASGI scope and hands every other request, and the lifespan, to the FastAPI app. Behaviour is
the app's: the same auth check, status codes, error bodies, Retry-After and metrics.

1. Check `Authorization` (when API keys are configured); read the body; parse it once (orjson).
2. Unary: `Proxy.unary` -> decode's bytes, sent with their length.
   Streaming: `Proxy.stream` returns once decode's first event arrived; its events are sent as they
   come while a watcher waits for the client's disconnect, which cancels the relay (the relay then
   aborts the room on both sides).
3. Count the request in `pdserve_router_requests_total` / `_e2e_seconds` (a stream counts itself).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson

from common import tracing
from router import reqlog, spans
from router.auth import auth_error
from router.protocol import ENDPOINTS, BadRequest, error_body, parse_request
from router.proxy import ClientGone, ProxyError

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON = b"application/json"
_END = {"type": "http.response.body", "body": b"", "more_body": False}


def parse_json(raw: bytes):
    """The request body as JSON (BadRequest when it is not)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from e


def _header(scope: dict, name: bytes) -> str:
    for k, v in scope["headers"]:
        if k == name:
            return v.decode("latin-1")
    return ""


async def _read_body(receive: Receive) -> bytes:
    parts = []
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone()
        parts.append(msg.get("body", b""))
        if not msg.get("more_body"):
            return parts[0] if len(parts) == 1 else b"".join(parts)


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_body(send: Send, status: int, body: bytes, headers: list | None = None) -> None:
    head = [(b"content-type", _JSON), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": head + (headers or [])})
    await send({"type": "http.response.body", "body": body})


async def _send_error(send: Send, status: int, message: str, headers: list | None = None,
                      retry_after: int = 0) -> None:
    """An error answer; with `retry_after` (seconds) both the body's `retry_after` and a Retry-After header."""
    if retry_after:
        headers = [*(headers or []), (b"retry-after", str(retry_after).encode())]
    await _send_body(send, status, orjson.dumps(error_body(message, status, retry_after=retry_after)), headers)


async def _send_stream(send: Send, receive: Receive, body: AsyncIterator[bytes]) -> None:
    """Send SSE bytes as they come; a client disconnect cancels the relay."""

    async def pump() -> None:
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        async for chunk in body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send(_END)

    pump_task = asyncio.ensure_future(pump())
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((pump_task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        pump_task.cancel()
        try:
            await pump_task
        except (asyncio.CancelledError, OSError):  # OSError: the client went away during a send
            pass
        await body.aclose()  # type: ignore[attr-defined]


class ProxyEndpoints:
    """ASGI app: answers the proxied endpoints itself, passes the rest to `app` (FastAPI)."""

    def __init__(self, app, state) -> None:
        self.app = app
        self.state = state  # router.app.RouterState
        self._endpoints = frozenset(ENDPOINTS)

    async def __call__(self, scope: dict, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._endpoints:
            await self.app(scope, receive, send)
        elif scope["method"] != "POST":
            await _send_error(send, 405, "method not allowed: use POST", [(b"allow", b"POST")])
        else:
            await self._proxied(scope["path"], scope, receive, send)

    async def _proxied(self, endpoint: str, scope: dict, receive: Receive, send: Send) -> None:
        st = self.state
        t0 = time.monotonic()
        status = 0
        span = spans.request_span(_header(scope, b"traceparent"), endpoint) if tracing.enabled() else None
        try:
            denied = auth_error(st.cfg, _header(scope, b"authorization"))
            if denied:
                status = 401
                return await _send_error(send, 401, denied)
            req = parse_request(endpoint, parse_json(await _read_body(receive)))
            if span is not None:
                req = dataclasses.replace(req, trace=span)
                span.set_attribute("stream", req.stream)
            disconnected = lambda: _wait_disconnect(receive)
            if req.stream:
                events = await st.proxy.stream(req, disconnected)
                status = -1  # counted by the stream itself when it ends
                return await _send_stream(send, receive, events)
            status, raw = await st.proxy.unary(req, disconnected)
            await _send_body(send, status, raw)
        except BadRequest as e:
            status = 400
            await _send_error(send, 400, str(e))
        except ProxyError as e:
            status = e.status
            await _send_error(send, e.status, e.message, retry_after=e.retry_after_s or 0)
        except ClientGone:
            status = 499
            await _send_body(send, 499, b"")
        finally:
            if status >= 0:
                st.metrics.requests.inc(endpoint=endpoint, status=str(status))
                st.metrics.e2e.observe(time.monotonic() - t0)
                if span is not None:
                    spans.end_request(span, status)
                if st.cfg.request_log:
                    reqlog.finished(endpoint, status, time.monotonic() - t0, span)
