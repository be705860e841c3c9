"""The spans of one request inside a worker process (common.tracing underneath).

A worker builds a `ReqTrace` for a GenerateReq that carries a traceparent while tracing is on
(`for_msg`, else None: every hook in the roles is skipped for untraced requests). The engine's `Req`
holds it in `Req.trace`, typed by the engine's `engine.request.Trace` protocol (what the roles call
on it). Spans are opened and closed by name as the request moves through the role's queues;
`close` ends whatever is still open when the request finishes (token_out calls it), marking them
failed when the request failed.

Span names (prefix = the worker's role): `<role>.<queue or phase>`, e.g. `prefill.bootstrap_queue`,
`prefill.chunk`, `prefill.kv_transfer`, `decode.admission`, `decode.kv_transfer`, `decode.running`,
`decode.retracted`; attributes carry counts (tokens, pages, bytes) and the room.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from common import tracing

if TYPE_CHECKING:
    from engine.request import Req
    from engine.scheduling.scheduler import Event


class ReqTrace:
    def __init__(self, parent: str, role: str) -> None:
        self.parent = parent  # the frontend span's traceparent
        self.role = role
        self.open: dict[str, Any] = {}

    @classmethod
    def for_msg(cls, traceparent: str, role: str) -> ReqTrace | None:
        return cls(traceparent, role) if traceparent and tracing.enabled() else None

    def begin(self, phase: str, **attrs: Any) -> None:
        """Open span `<role>.<phase>` (a phase already open is ended first)."""
        self.end(phase)
        self.open[phase] = tracing.start(f"{self.role}.{phase}", self.parent, attrs)

    def ensure(self, phase: str, **attrs: Any) -> None:
        """Open `phase` unless it is open already."""
        if phase not in self.open:
            self.begin(phase, **attrs)

    def end(self, phase: str, end_ns: int | None = None, **attrs: Any) -> None:
        """End `phase` if open (at `end_ns`, default now)."""
        span = self.open.pop(phase, None)
        if span is not None:
            if attrs:
                span.set_attributes(attrs)
            span.end(end_time=end_ns)

    def annotate(self, phase: str, **attrs: Any) -> None:
        """Set attributes on `phase` if it is open."""
        span = self.open.get(phase)
        if span is not None:
            span.set_attributes(attrs)

    def span(self, phase: str, start_ns: int, end_ns: int, **attrs: Any) -> None:
        """A span whose times are known (e.g. one forward shared by a batch)."""
        s = tracing.start(f"{self.role}.{phase}", self.parent, attrs, start_ns=start_ns)
        if s is not None:
            s.end(end_time=end_ns)

    def close(self, error: str | None = None) -> None:
        """End every open span; `error` marks them failed."""
        for phase in list(self.open):
            if error:
                tracing.fail(self.open[phase], error)
            self.end(phase)


def scheduler_event(name: str, r: Req) -> None:
    """engine.scheduling.scheduler.Scheduler's on_event: queue -> running, retracted to host and back."""
    t = r.trace
    if t is None:
        return
    if name == "running":
        t.end("queue")
        t.ensure("running")
    elif name == "retract":
        t.begin("retracted", host_pages=len(r.kv.host_pages), kv_tokens=r.kv.kv_len)
    elif name == "reload":
        t.end("retracted", pages=len(r.kv.pages))


def scheduler_hook() -> Event | None:
    """The Scheduler's on_event in this process: None (no calls at all) while tracing is off."""
    return scheduler_event if tracing.enabled() else None
