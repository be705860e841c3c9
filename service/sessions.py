"""Sessions in a service's frontend (SGLang's API; colocated services only):

    POST /open_session  {"capacity_of_str_len": int, "session_id"?: str}  -> the session id (a JSON string)
    POST /close_session {"session_id": str}                               -> {"success": true}
    POST /generate with "session_params": {"id", "rid"?, "offset"?, "replace"?}

A session remembers its requests' tokens (prompt then output, as the worker computed them). A
/generate with `session_params` continues request `rid` of session `id` (default: the session's
last request; none for its first): its prompt is that request's tokens, cut at `offset` when given
(-1: all), followed by the request's own text or input_ids, so the client sends only the new
tokens and gets exactly what resending the whole history would give. `replace`: the session then
forgets its other requests. `capacity_of_str_len` bounds a session request's prompt, in tokens (a
longer one is refused with a 400). The worker keeps the KV of the session's last request pinned in
its prefix cache (engine.scheduling.sessions), so only the new tokens are computed. A session idle for
`--session-timeout` seconds is forgotten (and its pin dropped by the worker on its own clock).

A prefill or decode service refuses sessions (400): a PD session would need its history on both
workers; the PD router refuses them too.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from common import api_schema
from common.api_requests import CacheKey, RequestInvalid, SessionParams, _Closed, validate
from common.http import error_body
from service.messages import CloseSessionReq
from service.parsed import RequestError, parse_json_body

MAX_SESSIONS = 4096  # open sessions per service (the oldest idle one goes first when full)
MAX_REQS_PER_SESSION = 16  # requests a session remembers (the oldest forgotten first)
MAX_CAPACITY = 1 << 20


class OpenSessionRequest(_Closed):
    capacity_of_str_len: int = Field(ge=1, le=MAX_CAPACITY, description="most prompt tokens one of its requests has")
    session_id: CacheKey | None = Field(None, description="default: a fresh random id")


class CloseSessionRequest(_Closed):
    session_id: CacheKey


class SessionError(ValueError):
    """A session request refused: `status` is the HTTP status, the message names the field."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.status = message, status


@dataclass
class _Session:
    capacity: int
    used: float
    reqs: OrderedDict[str, list[int]] = field(default_factory=OrderedDict)  # rid -> prompt + output ids
    last: str = ""


class SessionStore:
    """The open sessions of one frontend; thread-safe (the parse thread reads, the loop records)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s, self.clock = timeout_s, clock
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, capacity: int, session_id: str | None = None) -> str:
        with self._lock:
            self._expire()
            sid = session_id or uuid.uuid4().hex
            if sid in self._sessions:
                raise SessionError(f"'session_id' {sid!r} is already open")
            if len(self._sessions) >= MAX_SESSIONS:
                oldest = min(self._sessions, key=lambda s: self._sessions[s].used)
                del self._sessions[oldest]
            self._sessions[sid] = _Session(capacity, self.clock())
            return sid

    def close(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def prompt(self, params: SessionParams, ids: list[int]) -> list[int]:
        """The prompt of a request continuing `params`: the continued request's tokens (cut at
        offset) then `ids`. SessionError (400) naming the field when it cannot be built."""
        with self._lock:
            self._expire()
            s = self._sessions.get(params.id)
            if s is None:
                raise SessionError(f"'session_params.id': no open session {params.id!r} (POST /open_session; "
                                   f"a session idle for {self.timeout_s:g}s is closed)")
            rid = params.rid or s.last
            if rid and rid not in s.reqs:
                raise SessionError(f"'session_params.rid': session {params.id!r} has no finished request {rid!r}")
            base = s.reqs[rid] if rid else []
            off = params.offset
            if off is not None and off != -1:
                if off > len(base):
                    raise SessionError(f"'session_params.offset' {off} is past the {len(base)} tokens of the "
                                       "request it continues")
                base = base[:off]
            s.used = self.clock()
            prompt = base + ids
            if len(prompt) > s.capacity:
                raise SessionError(f"'session_params': the prompt would hold {len(prompt)} tokens, over the "
                                   f"session's capacity_of_str_len {s.capacity}")
            return prompt

    def record(self, session_id: str, rid: str, tokens: list[int], replace: bool = False) -> None:
        """A request of the session finished: its tokens (prompt then output) can be continued."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                return  # closed meanwhile
            if replace:
                s.reqs.clear()
            s.reqs[rid] = tokens
            s.reqs.move_to_end(rid)
            while len(s.reqs) > MAX_REQS_PER_SESSION:
                s.reqs.popitem(last=False)
            s.last, s.used = rid, self.clock()

    def _expire(self) -> None:
        now = self.clock()
        for sid in [sid for sid, s in self._sessions.items() if now - s.used >= self.timeout_s]:
            del self._sessions[sid]


def session_prompt(body: dict[str, Any], ids: list[int], store: SessionStore | None,
                   role: str) -> tuple[list[int], SessionParams | None]:
    """/generate's prompt ids and its validated session_params (None without them); a
    service.protocol.RequestError (400) naming the field when they cannot be used."""
    raw = body.get("session_params")
    if raw is None:
        return ids, None
    if body.get("input_embeds") is not None:
        raise RequestError("'session_params' cannot be combined with 'input_embeds' (a session continues token ids)")
    if role != "colocated" or store is None:
        raise RequestError(f"'session_params': sessions are served by a colocated service; a {role} service "
                           "(prefill/decode disaggregation) does not keep them")
    if not isinstance(raw, dict):
        raise RequestError(f"'session_params' must be an object {{id, rid?, offset?, replace?}}, got {raw!r:.50}")
    try:
        params = validate(SessionParams, raw)
        return store.prompt(params, ids), params
    except RequestInvalid as e:
        raise RequestError(f"'session_params': {e}") from None
    except SessionError as e:
        raise RequestError(e.message, e.status) from None


def attach_session(parsed: Any, params: SessionParams | None) -> None:
    """Mark a parsed /generate as its session's (the worker pins its KV when it ends); one choice only."""
    if params is None:
        return
    if parsed.req.n > 1:
        raise RequestError("'session_params' continues one request: it cannot be combined with 'n' > 1")
    parsed.session = params
    parsed.req = replace(parsed.req, options=replace(parsed.req.options, session_id=params.id))


def record_finished(store: SessionStore | None, parsed: Any, output_ids: list[int], status: int) -> None:
    """After a /generate with session_params ended (status 200 only): remember its tokens."""
    params = getattr(parsed, "session", None)
    if store is None or params is None or status != 200:
        return
    store.record(params.id, parsed.req.rid, list(parsed.req.input_ids) + list(output_ids), bool(params.replace))


def _error(message: str, status: int) -> JSONResponse:
    return JSONResponse(error_body(message, status), status_code=status)


def add_session_routes(app: FastAPI, state: Any) -> None:
    """POST /open_session and /close_session on a service's app (`state`: service.frontend.FrontendState)."""

    def refused() -> JSONResponse | None:
        if state.config.role == "colocated" and state.sessions is not None:
            return None
        return _error(f"sessions are served by a colocated service; this {state.config.role} service "
                      "(prefill/decode disaggregation) does not keep them", 400)

    async def body_of(request: Request, model: type) -> Any:
        try:
            return validate(model, parse_json_body(await request.body()))
        except RequestInvalid as e:
            raise SessionError(str(e)) from None

    async def open_session(request: Request) -> Response:
        if (denied := refused()) is not None:
            return denied
        try:
            m = await body_of(request, OpenSessionRequest)
            return JSONResponse(state.sessions.open(m.capacity_of_str_len, m.session_id))
        except SessionError as e:
            return _error(e.message, e.status)

    async def close_session(request: Request) -> Response:
        if (denied := refused()) is not None:
            return denied
        try:
            m = await body_of(request, CloseSessionRequest)
        except SessionError as e:
            return _error(e.message, e.status)
        if not state.sessions.close(m.session_id):
            return _error(f"'session_id': no open session {m.session_id!r}", 404)
        await state.bridge.send(CloseSessionReq(session_id=m.session_id))
        return JSONResponse({"success": True})

    app.post("/open_session", responses=api_schema.errors(400, 401),
             openapi_extra=api_schema.body_docs(OpenSessionRequest))(open_session)
    app.post("/close_session", responses=api_schema.errors(400, 401, 404),
             openapi_extra=api_schema.body_docs(CloseSessionRequest))(close_session)
