"""Sessions (`POST /open_session`, `/close_session`, `session_params`) through the PD router: refused
with a 400 naming the feature. A session's next request is built from its history on the worker that
served it, which a prefill/decode pair does not keep; colocated services serve sessions
(service/sessions.py). /generate bodies with `session_params` are refused in router.protocol."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from router.protocol import error_body

REFUSED = ("sessions are served by colocated services (pdserve colocated: POST /open_session there); a "
           "prefill/decode router does not keep them: send the whole history instead")


def add_session_routes(app: FastAPI) -> None:
    async def refuse() -> Response:
        return JSONResponse(error_body(REFUSED, 400), status_code=400)

    for path in ("/open_session", "/close_session"):
        app.post(path, include_in_schema=False)(refuse)  # not in the document: never served here
