"""The HTTP API as pydantic models, for the OpenAPI document only (/openapi.json, /docs) of the router
and of every service: request and response bodies of /v1/chat/completions, /v1/completions and
/generate, and the error responses.

Nothing validates a body against these models: the services parse each request once in
service/protocol.py (its clear 400 messages are the contract), and the router's hot path (router/asgi.py)
never reaches FastAPI. `route_docs(path)` gives the keyword arguments of a FastAPI route declaration
(request body by reference in `openapi_extra`, so FastAPI reads no body; `response_model` documents the
answer and is skipped because the handlers return Response objects); `install(app)` adds the request
models to the app's schema components.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

REF = "#/components/schemas/{model}"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields a server may ignore


# ---- requests ---------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(_Open):
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, description="-1 = off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, description="the same seed gives the same text, PD or colocated")
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    stream: bool = False
    stream_options: StreamOptions | None = None


class ContentPart(BaseModel):
    type: str = Field(description="only 'text' is supported")
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Open):
    role: str = Field(description="system, user, assistant, developer or tool")
    content: str | list[ContentPart] | None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's earlier calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema every reply follows")
    strict: bool | None = Field(None, description="replies always follow the schema, strict or not")


class ResponseFormat(BaseModel):
    type: str = Field("text", description="text, json_object or json_schema (xgrammar-constrained decoding)")
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(BaseModel):
    name: str = Field(description="1-64 letters, digits, '_' or '-'")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments object")


class ToolDef(BaseModel):
    type: str = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: str = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated alias of max_completion_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")
    n: int = Field(1, ge=1, le=64, description="choices (1..64): the prompt is computed once and its KV shared; "
                                              "with a seed, choice i draws from a seed derived from (seed, i)")
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = Field(None, description="functions the reply may call (one call per reply)")
    tool_choice: str | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required, or a named function; required and named "
                          "replies are constrained to a valid call")


class CompletionRequest(SamplingFields):
    model: str | None = None
    prompt: str | list[int] | list[str] | list[list[int]] = Field(description="one prompt per request")
    max_tokens: int | None = Field(None, ge=0, description="0 only with echo: the prompt (and its logprobs) alone")
    logprobs: int | None = Field(None, ge=0, le=5, description="alternatives per token")
    echo: bool = Field(False, description="the prompt in front of the text (and its logprobs)")
    n: int = Field(1, ge=1, le=64, description="choices (1..64): the prompt is computed once and its KV shared; "
                                              "with a seed, choice i draws from a seed derived from (seed, i)")
    response_format: ResponseFormat | None = None


class GenerateRequest(_Open):
    text: str | None = Field(None, description="give text or input_ids")
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = Field(
        None, description="temperature, top_p, top_k, min_p, max_new_tokens, min_new_tokens, stop, "
                          "stop_token_ids, ignore_eos, seed, skip_special_tokens, frequency_penalty, "
                          "presence_penalty, repetition_penalty, logit_bias, n (1..64 choices: the answer "
                          "is then a list of n results, each streamed result carries its index); "
                          "structured output: at most one "
                          "of json_schema (a string or object), regex, ebnf")
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = Field(0, ge=0, le=20, description="needs return_logprob")
    logprob_start_len: int = Field(-1, ge=-1, description="-1: output logprobs only; k: prompt positions k..")
    rid: str | None = None


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
    output_top_logprobs: list[list[list[Any]]] | None = None
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
    401: "missing or wrong API key",
    404: "unknown path or model",
    413: "request body too large",
    429: "too many requests",
    503: "no worker available or the service is draining (Retry-After)",
}

_ENDPOINTS = {  # path -> (request model, response model, summary)
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletionResponse, "OpenAI chat completion"),
    "/v1/completions": (CompletionRequest, CompletionResponse, "OpenAI text completion"),
    "/generate": (GenerateRequest, GenerateResponse, "SGLang-style native generation"),
}
PATHS = tuple(_ENDPOINTS)


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
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            **{code: {"model": ErrorResponse, "description": text} for code, text in ERRORS.items()},
        },
        "openapi_extra": {"requestBody": {"required": True, "content": {"application/json": {"schema": body}}}},
    }


def install(app: Any) -> None:
    """Make `app.openapi()` carry the request models (referenced by route_docs) in its components."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            _, defs = models_json_schema([(m[0], "validation") for m in _ENDPOINTS.values()], ref_template=REF)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
