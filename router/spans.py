"""The router's spans of one request (common.tracing underneath; only called while tracing is on).

    router.request   the whole request (root; continues the client's traceparent); a stream ends it
                     when the relay ends, everything else when router.asgi answers
    router.attempt   one try on a prefill/decode pair (plus encoder): attempt number, workers, room; failed with the
                     blamed side when the pair failed (a retry is the next attempt span)
    router.pick      one per role and attempt: the worker picked, the wait for an eligible one included
                     (role encoder: only for an image request while an encoder is eligible)
    router.stream    relaying decode's events: event count and outcome

Workers join the trace through the attempt's traceparent, sent as an HTTP header on every post.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from common import tracing


def request_span(traceparent: str, endpoint: str) -> Any:
    return tracing.start("router.request", traceparent or None, {"endpoint": endpoint}, kind="server")


def end_request(span: Any, status: int) -> None:
    span.set_attribute("status", status)
    if status >= 400:
        tracing.fail(span, f"status {status}")
    span.end()


def attempt_span(request: Any, n: int) -> Any:
    return tracing.start("router.attempt", request, {"attempt": n})


def attempt_failed(span: Any, side: str, worker_url: str, message: str) -> None:
    tracing.fail(span, message)
    span.set_attributes({"blamed": side, "blamed_worker": worker_url})


async def traced_pick(pick: Callable[[], Awaitable[Any]], parent: Any, role: str, avoid: int,
                      eligible: Callable[[], int]) -> Any:
    """`await pick()` inside a router.pick span; a failure (no worker) marks the span failed."""
    span = tracing.start("router.pick", parent, {"role": role, "avoid": avoid})
    try:
        w = await pick()
        span.set_attributes({"worker": w.url, "eligible": eligible()})
        return w
    except Exception as e:
        tracing.fail(span, str(e))
        raise
    finally:
        span.end()


def stream_span(request: Any, decode_url: str) -> Any:
    return tracing.start("router.stream", request, {"decode": decode_url})


def end_stream(span: Any, request: Any, outcome: str, n_events: int) -> None:
    """End router.stream and the request's span (router.asgi leaves a stream's to the relay)."""
    for s in (span, request):
        s.set_attributes({"outcome": outcome, "events": n_events})
        if outcome != "200":
            tracing.fail(s, outcome)
        s.end()
