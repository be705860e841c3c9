"""The HTTP API in the OpenAPI document (/openapi.json, /docs) of the router and of every service: the
request models of /v1/chat/completions, /v1/completions and /generate (common/api_requests.py, the same
models the services parse with), their answers, and every status and content type an endpoint returns.

The router's hot path (router/asgi.py) never reaches FastAPI: it relays bytes and checks only what it
needs itself. A service's handlers read the raw body and parse it once with the request models
(service/protocol.py). `route_docs(path)` gives the keyword arguments of a FastAPI route declaration
(request body by reference in `openapi_extra`, so FastAPI reads no body; `response_model` documents the
answer and is skipped because the handlers return Response objects); `errors`, `plain_text` and
`status_object` document the
answers of the other routes; `install(app)` adds the request models to the app's schema components.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from common.api_requests import ChatCompletionRequest, CompletionRequest, GenerateRequest, ToolCall
from common.http import error_body

REF = "#/components/schemas/{model}"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- responses --------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = Field(description="null when the reply is a tool call")
    tool_calls: list[ToolCall] | None = Field(None, description="finish_reason is then 'tool_calls'")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class GenerateMeta(_Open):
    id: str
    finish_reason: dict[str, Any] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[list[Any]] | None = Field(None, description="[logprob, id, null] per token")
    output_top_logprobs: list[list[list[Any]] | None] | None = None
    input_token_logprobs: list[list[Any]] | None = None
    input_top_logprobs: list[list[list[Any]] | None] | None = None


class GenerateResponse(BaseModel):
    text: str
    output_ids: list[int]
    meta_info: GenerateMeta


class ErrorDetail(_Open):
    message: str
    type: str
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


ERRORS = {
    400: "invalid request (the message names the field)",
    401: "missing or wrong API key (router) or internal token (service)",
    404: "unknown path, model or worker",
    409: "a conflict: the router runs several processes (admin), requests are running (flush_cache)",
    413: "request body too large",
    429: "too many requests",
    499: "the client disconnected before the answer (the router sends no body)",
    500: "the worker failed the request",
    502: "every attempt failed on a worker fault (router)",
    503: "no worker available, the worker is not running, or the service is draining (Retry-After)",
    504: "every attempt timed out (router)",
}
_PROXIED_ERRORS = (400, 401, 404, 413, 429, 499, 500, 502, 503, 504)

_ENDPOINTS = {  # path -> (request model, response model, summary)
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, "OpenAI chat completion"),
    "/v1/completions": (CompletionRequest, CompletionResponse, "OpenAI text completion"),
    "/generate": (GenerateRequest, GenerateResponse | list[GenerateResponse], "SGLang-style native generation "
                  "(with sampling_params.n > 1: a list of n results)"),
}
PATHS = tuple(_ENDPOINTS)


_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a JSON chunk (an error object on failure), then [DONE]"}}}


def route_docs(path: str) -> dict[str, Any]:
    """FastAPI route keyword arguments that document `path` without validating anything."""
    req, resp, summary = _ENDPOINTS[path]
    body = {"$ref": REF.format(model=req.__name__)}
    return {
        "summary": summary,
        "response_model": resp,
        "responses": {
            200: {"description": "the answer, or with stream=true a text/event-stream of chunks ending "
                                 "with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
            **errors(*_PROXIED_ERRORS),
        },
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
    }


def errors(*codes: int) -> dict[int | str, Any]:
    """FastAPI `responses` entries: each code answered with the error model."""
    return {code: {"model": ErrorResponse, "description": ERRORS[code]} for code in codes}


def plain_text(what: str) -> dict[int | str, Any]:
    """FastAPI `responses` of a route answering 200 as text/plain (declare it with
    `response_class=PlainTextResponse` so no application/json is documented)."""
    return {200: {"description": what, "content": {"text/plain": {"schema": {"type": "string"}}}}}


def status_object(code: int, what: str) -> dict[int | str, Any]:
    """A non-error status answered with a JSON object that is not the error model (/health's 503)."""
    return {code: {"description": what, "content": {"application/json": {"schema": {"type": "object"}}}}}


_WORKER_URL = r"^https?://[A-Za-z0-9.-]*[A-Za-z0-9](:[0-9]{1,5})?/?$"


class AddWorkerRequest(BaseModel):
    """`POST /admin/workers` (router): a worker the router may use."""

    model_config = ConfigDict(strict=True, json_schema_extra={  # bootstrap_port only for a prefill or an encoder
        "if": {"properties": {"role": {"const": "decode"}}},
        "then": {"properties": {"bootstrap_port": {"type": "null"}}}})
    url: str = Field(pattern=_WORKER_URL, description="http://host:port")
    role: Literal["prefill", "decode", "encoder"]
    bootstrap_port: int | None = Field(None, ge=1, le=65535, description="prefill or encoder only; absent: read "
                                                                         "/server_info")

    @field_validator("url", mode="before")
    @classmethod
    def _url(cls, v: Any) -> Any:
        if not isinstance(v, str) or not re.fullmatch(_WORKER_URL, v):
            raise ValueError(f"worker URL must look like http://host:port, got {v!r}")
        return v

    @model_validator(mode="after")
    def _port_for_prefill(self) -> AddWorkerRequest:
        if self.bootstrap_port is not None and self.role == "decode":
            raise ValueError("'bootstrap_port' must be an integer and only for role prefill or encoder")
        return self


def body_docs(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a JSON request body a handler reads itself (install() adds the model)."""
    _BODIES[model.__name__] = model
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": REF.format(model=model.__name__)}}}}}


_BODIES: dict[str, type[BaseModel]] = {}  # every model body_docs referenced, by name


def install(app: Any) -> None:
    """Make `app.openapi()` carry the request models (referenced by route_docs) in its components."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            models = list(dict.fromkeys([m[0] for m in _ENDPOINTS.values()] + list(_BODIES.values())))
            _, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


# ---- FastAPI's own errors ---------------------------------------------------------------------------
def install_http_errors(app: FastAPI) -> None:
    """FastAPI's own 404/405 in the error model, on the router's app and every service's; a 405's
    `Allow` lists every method of the path (RFC 9110; Starlette's names only the first route's)."""

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code, headers)


def allowed_methods(app: FastAPI, scope: dict) -> list[str]:
    """The methods the app's routes take at the request's path."""
    found: list[str] = []
    for route in app.router.routes:
        if route.matches(scope)[0] != Match.NONE:
            found += [m for m in sorted(getattr(route, "methods", None) or ()) if m not in found]
    return found
