"""Prefill/decode (and encoder, for requests with images) dispatch of one client request.

1. Pick a prefill P and a decode D (each role's policy, over eligible workers, avoiding workers that
   already failed this request), mint a random 63-bit `bootstrap_room`.
2. POST the body plus `bootstrap_host`/`bootstrap_port` (P's bootstrap server)/`bootstrap_room` to P
   and D at once. P gets `stream: false`: its JSON answer tells the router whether prefill worked (and
   carries the prompt's input logprobs); D's answer (JSON or SSE stream) is what the client gets.
   E/P/D: a request with images (`ProxyRequest.images`) also gets an encoder E when one is eligible that has
   neither failed nor refused it (least outstanding requests, ties in rotation; never waited for). E gets the
   body as P does (`stream: false`) with its own bootstrap server and the room; P's body adds
   `encoder_bootstrap_host`/`encoder_bootstrap_port` (E's): E sends the image embeddings to P as P sends KV
   to D. All three are posted at once; E answers once the embeddings were sent. With no such encoder the
   request goes P -> D (the prefill runs the vision tower itself); counted either way in
   `pdserve_router_image_requests_total{path="epd"|"pd"}`.
3. Until the first token reaches the client (unary: until D's whole answer), a failure of any side
   (transport error, timeout, 5xx, error object; E is a side like P) aborts the room on every side and the
   request is retried on another pair (triple) with a new room, at most `max_retries` times. The failure
   counts against the worker that caused it: the side that answered, unless its error names another role
   of the attempt as at fault (`error.fault`, e.g. a decode whose prefill went silent, a prefill whose
   encoder did). A 4xx is the client's fault: it is relayed, not retried. A client disconnect aborts
   every side. When no prefill or decode is eligible, the request waits up to `worker_wait_s` for one
   (health probes re-admit workers), then gets a 503 with Retry-After.
   An overload refusal (a 503 whose error names `retry_after`: a full queue, a queue deadline passed;
   for a stream, its first event) is no failure: nothing is recorded against the worker, the attempt
   is re-run on another worker of that role that has not refused the request (within `max_retries`),
   and when none is left the client gets that 503 with the largest Retry-After the workers named. An
   encoder that failed or refused is not picked again for the request; with none left the next attempt
   goes P -> D.
4. Once streaming began, a failure of D (transport error, stream cut before `[DONE]`, a 5xx error
   event) migrates the stream (router/migration.py): the request goes to another pair (with a new
   encoder for an image request, or none) with the prompt plus the tokens streamed so far and the
   remaining budget, and the client's stream continues with the same id, at most `migration_limit` times.
   Otherwise (or with no worker left) the stream ends with a `data: {"error": ...}` event. A stream that
   does not end cleanly (error, client disconnect) aborts the room on every side.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

import orjson

from common import tracing
from router import lora, reqlog, spans
from router.client import TRANSPORT_ERRORS, HttpxResponse, WorkerClient
from router.http1 import Response
from router.kv_index import ExactPrompt, KVIndex, cached_tokens_of
from router.metrics import RouterMetrics
from router.migration import StreamLedger, migratable, with_token_ids
from router.policies import LeastLoad, Policy
from router.prompt_ids import PromptTokenizer
from router.protocol import (
    ProxyRequest,
    error_body,
    error_of,
    fault_of,
    merge_input_logprobs,
    retry_after_of,
    sse_event,
)
from router.registry import Lease, Registry, Worker
from router.sse import ERROR_KEY, SSEReader, event_json, is_done

DONE_EVENT = b"data: [DONE]\n\n"
log = logging.getLogger(__name__)

Disconnected = Callable[[], Awaitable[None]]
WATCH_AFTER_S = 0.05  # a client disconnect is noticed at most this much later than it happened


class ProxyError(Exception):
    """Ends a request with an error answer before anything was sent to the client."""

    def __init__(self, status: int, message: str, retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after_s = retry_after_s  # sent as a Retry-After header when set


class ClientGone(Exception):
    """The client disconnected while the router was waiting on workers."""


@dataclass
class SideResult:
    worker: Worker
    status: int  # HTTP status; 0 = transport error or timeout
    body: Any = None
    message: str = ""
    raw: bytes = b""  # the body as received (relayed as is when nothing was merged into it)
    fault: str = ""  # the role the worker's error blames ("prefill" | "decode" | "encoder"), "" = itself
    retry_after: int = 0  # an overload refusal's seconds to wait (its error's `retry_after`), 0 = none

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300 and error_of(self.body) is None

    @property
    def busy(self) -> bool:
        """An overload refusal: the worker is sound but full, so another worker of its role is tried."""
        return self.status == 503 and self.retry_after > 0

    @property
    def worker_fault(self) -> bool:
        return self.status == 0 or self.status >= 500


class AttemptFailed(Exception):
    """One attempt failed; `side`/`worker` is who is blamed (or refused it, `result.busy`), which may be
    the other side of `result`."""

    def __init__(self, side: str, worker: Worker, result: SideResult) -> None:
        super().__init__(f"{side} {worker.url}: {result.message}")
        self.side = side
        self.worker = worker
        self.result = result


class Refusals:
    """The workers that refused one request as overloaded (`SideResult.busy`), by role: never picked again
    for it. `error()` is the client's 503 once none is left: the last refusal's message and the largest
    Retry-After any of them named."""

    def __init__(self) -> None:
        self.urls: dict[str, set[str]] = {"prefill": set(), "decode": set(), "encoder": set()}
        self.message = ""
        self.retry_after_s = 0

    def add(self, role: str, worker: Worker, res: SideResult) -> None:
        self.urls[role].add(worker.url)
        self.message = res.message or f"{role} worker {worker.url} is overloaded"
        self.retry_after_s = max(self.retry_after_s, res.retry_after)

    def error(self) -> ProxyError:
        return ProxyError(503, self.message, retry_after_s=self.retry_after_s)


@dataclass(slots=True)
class Picks:
    """One attempt's workers and room: prefill P, decode D and, for an image request when an encoder was
    eligible, encoder E (else None: P -> D)."""

    p: Worker
    d: Worker
    room: int
    e: Worker | None = None
    p_cached: int = 0  # prompt tokens the prefill policy predicts P holds (its KV index): P's lease counts the rest

    def sides(self) -> dict[str, Worker]:
        sides = {"prefill": self.p, "decode": self.d}
        if self.e is not None:
            sides["encoder"] = self.e
        return sides

    def urls(self) -> dict[str, str]:
        """The workers by role, for the request log and spans."""
        return {role: w.url for role, w in self.sides().items()}


@dataclass
class _Leg:
    """How relaying one decode's stream ended."""

    outcome: str = "client_disconnect"  # "200", "stream_error" (an error event was relayed)
    failure: str = ""  # the decode failed (its stream may be migrated): what happened
    detail: str = ""  # for the worker's failure record
    events: int = 0  # events relayed (for the stream span and the request log)


@dataclass
class StreamStart:
    response: Response | HttpxResponse
    reader: SSEReader
    first: bytes  # the first raw SSE event (re-encoded when input logprobs were merged into it)
    lease: Lease


def _result(w: Worker, status: int, content: bytes) -> SideResult:
    try:
        body = orjson.loads(content) if content else None
    except orjson.JSONDecodeError:  # a ValueError; UTF-8 errors included
        body = None
    err = error_of(body)
    if err is not None:
        return _error_result(w, status if status >= 400 else err[0], body, err[1])
    if 200 <= status < 300 and body is None:
        return SideResult(w, 502, None, "worker answered with a body that is not JSON")
    message = "" if status < 400 else content[:500].decode("utf-8", "replace")
    return SideResult(w, status, body, message, content)


def _error_result(w: Worker, status: int, obj: Any, message: str) -> SideResult:
    """A worker's error object (a JSON body or a stream's first event) as its side's result."""
    return SideResult(w, status, obj, message, fault=fault_of(obj), retry_after=retry_after_of(obj))


async def _never() -> None:
    await asyncio.Event().wait()


class Proxy:
    def __init__(
        self,
        registry: Registry,
        client: WorkerClient,
        policies: dict[str, Policy],
        metrics: RouterMetrics,
        max_retries: int,
        worker_wait_s: float = 0.0,
        retry_after_s: int = 1,
        request_log: bool = False,
        migration_limit: int = 0,
        local_prefill_queue_tokens: int = 0,
    ) -> None:
        self.registry = registry
        self.client = client
        self.policies = {"encoder": LeastLoad(), **policies}  # encoders: least outstanding requests, ties rotate
        self.metrics = metrics
        self.max_retries = max_retries
        self.worker_wait_s = worker_wait_s  # how long a request waits for an eligible worker of a role
        self.retry_after_s = retry_after_s  # Retry-After of the 503 when none came
        self.request_log = request_log  # a JSON line per finished stream (router.reqlog)
        self.migration_limit = migration_limit  # times one stream may move to another pair mid-stream
        # conditional disaggregation: with this many prompt tokens outstanding on the picked prefill,
        # the decode is asked to prefill the request itself (0: never)
        self.local_prefill_queue_tokens = local_prefill_queue_tokens
        self._background: set[asyncio.Task] = set()
        self.kv_index: KVIndex | None = None  # set with --kv-events auto: prefills' reported cached tokens go there
        self.prompt_ids: PromptTokenizer | None = None  # set with it for cache_aware: text and chat prompts' ids

    # ---- public API -------------------------------------------------------------------------------
    async def unary(self, req: ProxyRequest, disconnected: Disconnected | None = None) -> tuple[int, bytes]:
        """Run a non-streaming request: decode's (status, JSON bytes). Raises ProxyError/ClientGone."""
        req = await self.with_prompt_ids(req)
        return await self._with_retries(req, lambda w, tp: self._attempt_unary(req, w, tp, disconnected))

    async def stream(
        self, req: ProxyRequest, disconnected: Disconnected | None = None
    ) -> AsyncIterator[bytes]:
        """Start a streaming request; returns the SSE byte iterator once decode's first event arrived."""
        t0 = time.monotonic()
        req = await self.with_prompt_ids(req)
        if migratable(req, self.migration_limit):
            req = with_token_ids(req)
        start, w = await self._with_retries(req, lambda w, tp: self._attempt_stream(req, w, tp, disconnected))
        return self._relay(req, start, w, t0)

    async def with_prompt_ids(self, req: ProxyRequest) -> ProxyRequest:
        """`req` with the token ids of its text or chat prompt when the KV index can score them
        (router/prompt_ids.py: PromptTokenizer.with_ids)."""
        if self.prompt_ids is None or not self.prompt_ids.ready or req.exact is not None:
            return req
        return await self.prompt_ids.with_ids(req, self.kv_index)

    # ---- pairing and retries ------------------------------------------------------------------------
    def _predicted_cached(self, p: Worker) -> int:
        """The prompt tokens the prefill policy's last pick predicted `p` holds (0 without a KV index)."""
        predicted = getattr(self.policies["prefill"], "predicted", None)
        return predicted(p.url) if predicted is not None else 0

    async def _pick(
        self, role: str, prefix: str, tried: set[str], refused: Refusals, span: Any = None, adapter: str = "",
        exact: ExactPrompt | None = None,
    ) -> Worker:
        """An eligible worker of `role` that has not refused the request, one it has not tried when there is
        one; ProxyError 503 when none is eligible (after `worker_wait_s`) or every eligible one refused."""
        if span is not None:
            return await spans.traced_pick(lambda: self._pick(role, prefix, tried, refused, None, adapter, exact), span,
                                           role, len(tried), lambda: len(self.registry.eligible(role)))
        eligible = self.registry.eligible(role) or await self.registry.wait_eligible(role, self.worker_wait_s)
        if not eligible:
            raise ProxyError(
                503,
                f"no healthy {role} worker available (waited {self.worker_wait_s:g}s for one)",
                retry_after_s=self.retry_after_s,
            )
        willing = [w for w in eligible if w.url not in refused.urls[role]]
        if not willing:
            raise refused.error()
        fresh = [w for w in willing if w.url not in tried]
        return self.policies[role].pick(lora.prefer(fresh or willing, adapter), prefix, exact)

    async def _pick_encoder(
        self, req: ProxyRequest, tried: set[str], refused: Refusals, span: Any = None
    ) -> Worker | None:
        """E/P/D: for an image request, an eligible encoder that has neither failed nor refused it (the encoder
        policy: least outstanding requests, ties in rotation); None for a text request or when there is none:
        the request then goes P -> D (the prefill runs the vision tower). Never waits for one."""
        if not req.images:
            return None
        shunned = refused.urls["encoder"]
        willing = [w for w in self.registry.eligible("encoder") if w.url not in tried and w.url not in shunned]
        if not willing:
            return None
        if span is not None:
            return await spans.traced_pick(lambda: self._pick_encoder(req, tried, refused), span, "encoder",
                                           len(tried), lambda: len(self.registry.eligible("encoder")))
        return self.policies["encoder"].pick(willing, req.prefix)

    async def _with_retries(self, req: ProxyRequest, attempt: Callable[[Picks, str], Awaitable[Any]],
                            avoid_decode: str = "") -> Any:
        """`attempt(picks, traceparent)` on picked workers until one succeeds, a client error ends it, or the
        attempts run out (ProxyError). An image request's path (epd | pd) is counted by its last attempt."""
        tried: dict[str, set[str]] = {"prefill": set(), "decode": {avoid_decode} - {""}, "encoder": set()}
        refused = Refusals()
        last: AttemptFailed | None = None
        path = ""
        try:
            for n in range(self.max_retries + 1):
                span = None if req.trace is None else spans.attempt_span(req.trace, n)
                try:
                    adapter = lora.adapter_of(req)
                    p = await self._pick("prefill", req.prefix, tried["prefill"], refused, span, adapter, req.exact)
                    p_cached = self._predicted_cached(p)  # read before the next await: another pick replaces it
                    d = await self._pick("decode", req.prefix, tried["decode"], refused, span, adapter, req.exact)
                    enc = await self._pick_encoder(req, tried["encoder"], refused, span) if req.images else None
                    if n:  # a retry is an attempt made again (not one every worker refused before it began)
                        self.metrics.retries.inc()
                    w = Picks(p, d, secrets.randbits(63), enc, p_cached)
                    path = "pd" if enc is None else "epd"
                    if span is not None:
                        span.set_attributes({**w.urls(), "room": w.room})
                    return await attempt(w, tracing.traceparent(span))
                except AttemptFailed as e:
                    if span is not None:
                        spans.attempt_failed(span, e.side, e.worker.url, str(e))
                    if e.result.busy:
                        self.metrics.worker_busy.inc(role=e.side)
                        refused.add(e.side, e.worker, e.result)
                    elif not e.result.worker_fault:
                        raise ProxyError(e.result.status, e.result.message or "worker refused the request") from e
                    else:
                        tried[e.side].add(e.worker.url)
                    last = e
                finally:
                    if span is not None:
                        span.end()
        finally:
            if req.images and path:
                self.metrics.image_requests.inc(path=path)
        assert last is not None
        if last.result.busy:  # the attempts ran out on a refusal: the client waits as the workers asked
            raise refused.error()
        status = 504 if "Timeout" in last.result.message else 502
        raise ProxyError(status, f"request failed after {self.max_retries + 1} attempt(s); last: {last}")

    def _check(self, side: str, res: SideResult, sides: dict[str, Worker]) -> None:
        """Record one side's answer; a failure raises AttemptFailed blaming the worker at fault (`error.fault`
        when it names a role of this attempt, else the side that answered), an overload refusal raises it
        naming the side that refused (and records nothing)."""
        if res.ok:
            self.registry.record_success(res.worker)
            return
        if res.busy:  # refused as overloaded (the side its fault names, e.g. a prefill relaying its decode's
            # refusal): the worker is sound, nothing is recorded against it
            refuser = res.fault if res.fault in sides else side
            raise AttemptFailed(refuser, sides[refuser], res)
        blamed = res.fault if res.fault in sides and res.worker_fault else side
        if res.worker_fault:
            self.registry.record_failure(sides[blamed], f"{res.message} (reported by {side} {res.worker.url})")
        raise AttemptFailed(blamed, sides[blamed], res)

    def _abort_all(self, w: Picks) -> None:
        """Abort the attempt's room on every side (an encoder takes the same abort as a prefill)."""
        self.client.abort_room_soon(w.p, w.room)
        self.client.abort_room_soon(w.d, w.room)
        if w.e is not None:
            self.client.abort_room_soon(w.e, w.room)

    def _keep(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _await_sides(
        self,
        req: ProxyRequest,
        sides: dict[str, Worker],
        p_task: asyncio.Task,
        d_task: asyncio.Task,
        e_task: asyncio.Task | None,
        disconnected: Disconnected | None,
    ) -> None:
        """Wait until decode answered (and prefill too when its logprobs are needed); fail fast on
        any side's failure (the encoder's included) or a client disconnect. The disconnect watcher (a task)
        starts only when the answer takes longer than WATCH_AFTER_S: most fast answers never need one."""
        watch: asyncio.Future | None = None
        pending = {p_task, d_task}
        if e_task is not None:
            pending.add(e_task)
        try:
            while d_task in pending or (req.input_logprobs and p_task in pending):
                if watch is None:
                    done, _ = await asyncio.wait(
                        pending, timeout=WATCH_AFTER_S, return_when=asyncio.FIRST_COMPLETED
                    )
                    if not done:
                        watch = asyncio.ensure_future((disconnected or _never)())
                        continue
                else:
                    done, _ = await asyncio.wait(pending | {watch}, return_when=asyncio.FIRST_COMPLETED)
                    if watch in done:
                        raise ClientGone()
                for t in done:
                    pending.discard(t)
                    res = t.result()
                    side = "decode" if t is d_task else "prefill" if t is p_task else "encoder"
                    self._check(side, res[0] if isinstance(res, tuple) else res, sides)
        finally:
            if watch is not None:
                watch.cancel()

    # ---- one attempt ----------------------------------------------------------------------------------
    async def _post_json(self, w: Worker, endpoint: str, body: dict, tokens: int, tp: str) -> SideResult:
        lease = self.registry.lease(w, tokens)
        try:
            resp = await self.client.hot.post(w.url, endpoint, orjson.dumps(body), tp)
            content = await resp.read()
        except TRANSPORT_ERRORS as e:
            return SideResult(w, 0, None, f"{type(e).__name__}: {e}")
        finally:
            lease.release()
        return _result(w, resp.status, content)

    def _report_cached(self, p: Worker, p_task: asyncio.Task) -> None:
        """The prefill's reported cached tokens, for the KV index's predicted vs reported (router/kv_index.py)."""
        if self.kv_index is not None and not p_task.cancelled() and p_task.exception() is None:
            self.kv_index.record_reported(p.url, cached_tokens_of(p_task.result().body))

    def _prefill_busy(self, p: Worker) -> bool:
        """The picked prefill's outstanding prompt tokens to compute (before this request's; the KV index's
        predicted cached tokens left out) reach the bound."""
        bound = self.local_prefill_queue_tokens
        busy = bound > 0 and p.outstanding_tokens >= bound
        if busy:
            self.metrics.prefill_here.inc()
        return busy

    async def _attempt(
        self,
        req: ProxyRequest,
        w: Picks,
        tp: str,
        disconnected: Disconnected | None,
        call_decode: Callable[[Worker, str, dict, int, str], Awaitable[Any]],
        answer: Callable[[asyncio.Task, Any], Any],
        abandoned: Callable[[asyncio.Task], None] | None = None,
    ) -> Any:
        """One attempt on the pair (P, D), or the triple (E, P, D): E gets the encoder body, P the prefill
        body and D the decode body at once (`call_decode`: D's call, a JSON post or a stream's opening), all
        are awaited until D answered (_await_sides), then `answer(p_task, D's result)` is the attempt's
        result. On any failure every call is cancelled (`abandoned` runs when D's call ends anyway) and the
        room is aborted on every side; on success P's (and E's) call is kept until it ends (its transfer
        bookkeeping)."""
        p, room = w.p, w.room
        host, port = p.bootstrap_host, p.bootstrap_port
        e_task: asyncio.Task | None = None
        encoder: tuple[str, int] | None = None
        if w.e is not None and w.e.bootstrap_port is not None:  # eligible: its port is known
            encoder = (w.e.bootstrap_host, w.e.bootstrap_port)
            e_task = asyncio.ensure_future(self._post_json(w.e, req.endpoint, req.encoder_body(*encoder, room), 0, tp))
        here = encoder is None and self._prefill_busy(p)  # the prefill that E sends to must be the one that runs it
        p_task = asyncio.ensure_future(
            self._post_json(p, req.endpoint, req.prefill_body(host, port, room, encoder),
                            max(0, req.prompt_tokens - w.p_cached), tp)  # the tokens P computes
        )
        d_task = asyncio.ensure_future(
            call_decode(
                w.d, req.endpoint, req.decode_body(host, port, room, here), req.prompt_tokens + req.max_new_tokens,
                tp,
            )
        )
        ok = False
        try:
            await self._await_sides(req, w.sides(), p_task, d_task, e_task, disconnected)
            out = answer(p_task, d_task.result())
            ok = True
            if self.kv_index is not None and req.exact is not None:
                p_task.add_done_callback(lambda t: self._report_cached(p, t))  # P may still be finishing
            return out
        finally:
            if ok:
                self._keep(p_task)  # prefill may still be finishing its transfer bookkeeping
                if e_task is not None:
                    self._keep(e_task)
            else:
                p_task.cancel()
                d_task.cancel()
                if e_task is not None:
                    e_task.cancel()
                if abandoned is not None:
                    d_task.add_done_callback(abandoned)
                self._abort_all(w)

    async def _attempt_unary(
        self, req: ProxyRequest, w: Picks, tp: str, disconnected: Disconnected | None
    ) -> tuple[int, bytes]:
        def answer(p_task: asyncio.Task, res: SideResult) -> tuple[int, bytes]:
            raw = res.raw
            if req.input_logprobs and isinstance(res.body, dict | list):  # /generate with n > 1: a list
                raw = orjson.dumps(merge_input_logprobs(req.endpoint, p_task.result().body, res.body))
            return res.status, raw

        return await self._attempt(req, w, tp, disconnected, self._post_json, answer)

    async def _open_stream(
        self, w: Worker, endpoint: str, body: dict, tokens: int, tp: str
    ) -> tuple[SideResult, StreamStart | None]:
        lease: Lease | None = self.registry.lease(w, tokens)
        resp: Response | HttpxResponse | None = None
        try:
            resp = await self.client.hot.post(w.url, endpoint, orjson.dumps(body), tp)
            if not resp.is_success:
                return _result(w, resp.status, await resp.read()), None
            reader = SSEReader(resp.next_chunk)
            first = await reader.next_event()
            if first is None:
                return SideResult(w, 502, None, "stream ended before its first event"), None
            # decoded once: the input-logprob merge and the error check read it
            obj = event_json(first)
            err = error_of(obj)
            if err is not None:
                return _error_result(w, err[0], obj, err[1]), None
            start = StreamStart(resp, reader, first, lease)
            resp = lease = None  # owned by the StreamStart now
            return SideResult(w, 200, obj), start
        except TRANSPORT_ERRORS as e:
            return SideResult(w, 0, None, f"{type(e).__name__}: {e}"), None
        finally:
            if resp is not None:
                resp.close()
            if lease is not None:
                lease.release()

    async def _attempt_stream(
        self, req: ProxyRequest, w: Picks, tp: str, disconnected: Disconnected | None
    ) -> tuple[StreamStart, Picks]:
        def answer(p_task: asyncio.Task, opened: tuple[SideResult, StreamStart | None]) -> tuple:
            res, start = opened
            assert start is not None
            if req.input_logprobs and isinstance(res.body, dict | list):  # /generate with n > 1: a list
                start.first = sse_event(merge_input_logprobs(req.endpoint, p_task.result().body, res.body))[:-2]
            return start, w

        return await self._attempt(req, w, tp, disconnected, self._open_stream, answer, _close_started_stream)

    # ---- relaying a started stream -----------------------------------------------------------------
    async def _relay(self, req: ProxyRequest, start: StreamStart, w: Picks, t0: float) -> AsyncIterator[bytes]:
        """Relay decode's stream; when the decode fails mid-stream, migrate the request to another
        pair (router/migration.py) and relay that stream on, or end with an error event."""
        outcome = "client_disconnect"
        self.metrics.ttft.observe(time.monotonic() - t0)
        span = None if req.trace is None else spans.stream_span(req.trace, w.d.url)
        n_events = 0  # counted for the span and the request log
        ledger = StreamLedger(start.first, self.migration_limit) if migratable(req, self.migration_limit) else None
        try:
            while True:
                outcome, leg = "client_disconnect", _Leg()
                try:
                    async with aclosing(self._relay_leg(start, ledger, leg)) as events:
                        async for out in events:
                            yield out
                finally:
                    start.lease.release()
                    start.response.close()
                    if leg.outcome != "200":
                        self._abort_all(w)
                outcome, n_events = leg.outcome, n_events + leg.events
                if not leg.failure:
                    break
                outcome = "stream_error"
                self.registry.record_failure(w.d, leg.detail)
                failed = f"decode worker {w.d.url} failed mid-stream: {leg.failure}"
                if ledger is None or not ledger.can_migrate():
                    yield sse_event(error_body(failed, 502)) + DONE_EVENT
                    break
                resumed = ledger.resumed(req)
                self.metrics.migrations.inc()
                log.info("migrating a %s stream after %d tokens: %s", req.endpoint, len(ledger.ids), failed)
                try:
                    start, w = await self._with_retries(  # an image request gets a new encoder (or none) too
                        resumed, lambda w2, tp, r=resumed: self._attempt_stream(r, w2, tp, None), w.d.url
                    )
                except ProxyError as e:
                    yield sse_event(error_body(f"{failed}; migration failed: {e.message}", e.status)) + DONE_EVENT
                    break
                except Exception as e:  # a started stream still ends with an event, never a cut connection
                    log.exception("migrating a %s stream failed", req.endpoint)
                    yield sse_event(error_body(f"{failed}; migration failed: {e!r}", 502)) + DONE_EVENT
                    break
        finally:
            self.metrics.requests.inc(endpoint=req.endpoint, status=outcome)
            self.metrics.e2e.observe(time.monotonic() - t0)
            if self.request_log:
                reqlog.finished(req.endpoint, outcome, time.monotonic() - t0, req.trace, stream=True,
                                **w.urls(), room=w.room, events=n_events)
            if span is not None:
                spans.end_stream(span, req.trace, outcome, n_events)

    async def _relay_leg(self, start: StreamStart, ledger: StreamLedger | None, leg: _Leg) -> AsyncIterator[bytes]:
        """Yield one decode's events as they come, every event that arrived together in one chunk. Events
        pass as bytes: only `[DONE]` and error events are recognised (sse.is_done, sse.may_be_error);
        with a ledger, token ids are read and stripped. A decode failure ends the leg with `leg.failure`."""
        last = time.monotonic()
        itl = self.metrics.itl.observe
        events: list[bytes] | None = [start.first]
        while events is not None:
            out: list[bytes] = []
            done = False
            for raw in events:
                if ledger is not None:
                    raw = ledger.take(raw)
                if ERROR_KEY in raw and (err := error_of(event_json(raw))) is not None:
                    if ledger is not None and err[0] >= 500 and ledger.can_migrate():
                        leg.failure, leg.detail = f"error {err[0]}", err[1]
                        break
                    leg.outcome = "stream_error"
                out.append(raw)
                if len(raw) < 24 and is_done(raw):
                    done = True
                    break
            if out:
                leg.events += len(out)
                yield out[0] + b"\n\n" if len(out) == 1 else b"\n\n".join(out) + b"\n\n"
            if done or leg.failure:
                break
            try:
                events = await start.reader.next_events()
            except TRANSPORT_ERRORS as e:
                leg.failure, leg.detail = type(e).__name__, repr(e)
                return
            now = time.monotonic()
            if events is not None:
                itl(now - last)
                for _ in range(len(events) - 1):
                    itl(0.0)  # events that arrived in the same chunk
            elif ledger is not None and not ledger.finished:
                leg.failure = leg.detail = "stream ended before [DONE]"
                return
            last = now
        if not leg.failure and leg.outcome == "client_disconnect":
            leg.outcome = "200"


def _close_started_stream(task: asyncio.Task) -> None:
    """A decode stream opened after its attempt was abandoned: close it and drop its load."""
    if task.cancelled() or task.exception() is not None:
        return
    _, start = task.result()
    if start is not None:
        start.lease.release()
        start.response.close()
