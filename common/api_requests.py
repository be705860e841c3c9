"""The request bodies of /v1/chat/completions, /v1/completions and /generate as pydantic models: the
OpenAPI document shows them (common/api_schema.py) and the services parse with them
(service/protocol.py: `validate(Model, body)` first, then what no schema can say: the vocabulary,
the context length, grammars that must compile, tool semantics).

Contract: a body these models accept passes every type, range and shape check the services make; one
they refuse raises `RequestInvalid` with one clear message naming the field. Types are strict (JSON's
true is not 1, "5" is not 5; an int is a number), but a whole number sent as a float (2.0) is that
integer, as JSON Schema says (`validate`). `null` means "not given" wherever the schema allows it, as
OpenAI clients send it. Validators keep the services' messages where they say more than pydantic's
(`'n' (choices per request) must be an integer in 1..64`). The router validates with them too
(router/protocol.py), so it refuses what the services refuse, with their message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 64  # choices per request (engine.scheduling.parallel.MAX_N: a test checks they agree)
MAX_NEW_TOKENS = 1 << 20  # engine.sampling.params.MAX_NEW_TOKENS_LIMIT
MAX_GRAMMAR_CHARS = 1 << 16  # engine.sampling.params.MAX_GRAMMAR_CHARS
MAX_RID_LEN = 256
MAX_STOP = 16
ROLES = ("system", "user", "assistant", "developer", "tool")


class RequestInvalid(ValueError):
    """A body the models refuse: the message names the field and says what it must be."""


class _Open(BaseModel):
    # OpenAI clients send fields a server may ignore; strict: no "5" -> 5, no true -> 1
    model_config = ConfigDict(extra="allow", strict=True)


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


TokenId = Annotated[int, Field(ge=0)]
Priority = Annotated[int, Field(ge=-(2**31), lt=2**31, description="with --enable-priority-scheduling: which "
                                "end is more urgent is a flag (default: higher values first); else ignored")]
CacheKey = Annotated[str, Field(min_length=1, max_length=MAX_RID_LEN)]
NonEmpty = Annotated[str, Field(min_length=1)]
Grammar = Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
TopK = Literal[-1] | Annotated[int, Field(ge=1)]
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^[0-9]+$")], Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=1024, description="token id -> bias in [-100, 100]",
                            json_schema_extra={"additionalProperties": False})]  # keys are token ids only


# ---- OpenAI requests --------------------------------------------------------------------------------
class StreamOptions(_Open):
    include_usage: bool = False


class SamplingFields(_Open):
    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None, description="-1 = off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2**63, description="the same seed gives the same text, PD or colocated")
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = Field(
        None, description="empty strings are ignored")
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    min_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS, description="at most the max tokens")
    logit_bias: LogitBias | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(1, ge=1, le=MAX_N, description=f"choices (1..{MAX_N}): the prompt is computed once and its "
                                                         "KV shared; with a seed, choice i draws from a seed derived "
                                                         "from (seed, i)")
    # request features (issue 40; SGLang's and vLLM's names)
    priority: Priority | None = None
    extra_key: CacheKey | None = Field(None, description="cache salt: cached prefixes are shared only between "
                                                          "requests with the same one")
    cache_salt: CacheKey | None = Field(None, description="vLLM's name of extra_key (both given: one salt of the two)")
    routing_key: CacheKey | None = Field(None, description="the router's cache_aware policy sends requests with the "
                                                            "same key to the same worker")


class TextPart(_Open):
    type: Literal["text"] = Field(description="a text part")
    text: str


class ImageURL(_Open):
    url: NonEmpty = Field(description="a data: URL (base64 PNG, JPEG, WebP), an http(s) URL (with "
                                      "--image-url-fetch) or a file under --image-dir")
    detail: Literal["auto", "low", "high"] | None = Field(None, description="accepted, ignored: the model's "
                                                                            "preprocessor config sets the size")


class ImagePart(_Open):
    type: Literal["image_url"] = Field(description="an image (vision-language models only)")
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCall(_Open):
    name: str
    arguments: str = Field("{}", description="the arguments as JSON text")


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


# at least one message has text (a non-empty string, two or more parts, one non-empty part, or earlier calls)
_SOME_TEXT = {"contains": {"anyOf": [
    {"properties": {"content": {"type": "string", "minLength": 1}}, "required": ["content"]},
    {"properties": {"content": {"type": "array", "minItems": 2}}, "required": ["content"]},
    {"properties": {"content": {"type": "array", "contains": {"properties": {"text": {"minLength": 1}}}}},
     "required": ["content"]},
    {"properties": {"content": {"type": "array", "contains": {"properties": {"type": {"const": "image_url"}}}}},
     "required": ["content"]},
    {"properties": {"role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}},
     "required": ["role", "tool_calls"]},
]}}


class ChatMessage(_Open):
    model_config = ConfigDict(json_schema_extra={"anyOf": [  # content may be null (or absent) for an assistant
        {"properties": {"role": {"const": "assistant"}}},
        {"properties": {"content": {"type": ["string", "array"]}}, "required": ["content"]}]})
    role: Literal["system", "user", "assistant", "developer", "tool"] = Field(
        description="system, user, assistant, developer (as system) or tool")
    content: str | list[ContentPart] | None = Field(None, description="null or absent: an assistant's only")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's earlier calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")


class JsonSchemaFormat(_Open):
    model_config = ConfigDict(populate_by_name=True)
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema every reply follows")
    strict: bool | None = Field(None, description="replies always follow the schema, strict or not")


class ResponseFormat(_Open):
    model_config = ConfigDict(json_schema_extra={  # json_schema needs its schema
        "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
        "then": {"required": ["json_schema"], "properties": {"json_schema": {"type": "object"}}}})
    type: Literal["text", "json_object", "json_schema"] = Field(
        "text", description="text, json_object or json_schema (xgrammar-constrained decoding)")
    json_schema: JsonSchemaFormat | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _kind(cls, v: Any) -> Any:
        if v not in ("text", "json_object", "json_schema"):
            raise ValueError(f"response_format type {v!r} is not supported (text, json_object, json_schema)")
        return v

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}")
        return self


class FunctionDef(_Open):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$", description="1-64 letters, digits, '_' or '-'")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="JSON schema of the arguments object")


class ToolDef(_Open):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"enum": ["auto", "required"]}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
        {"if": {"required": ["tool_choice"], "properties": {"tool_choice": {"type": "object"}}},
         "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}},
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}]})
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1, json_schema_extra=_SOME_TEXT,
                                        description="at least one message has text")
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="deprecated alias of "
                                                                            "max_completion_tokens")
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDef], Field(max_length=128)] | None = Field(
        None, description="functions the reply may call (one call per reply), each name once")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none, auto (default with tools), required, or a named function from tools; required "
                          "and named replies are constrained to a valid call")


Prompt = (Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
          | Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]
          | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=1)])


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={  # max_tokens 0 only with echo
        "if": {"not": {"required": ["echo"], "properties": {"echo": {"const": True}}}},
        "then": {"properties": {"max_tokens": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 1}]}}}})
    model: str | None = None
    prompt: Prompt = Field(description="one non-empty prompt per request: text or token ids")
    max_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS,
                                   description="0 only with echo: the prompt (and its logprobs) alone")
    logprobs: int | None = Field(None, ge=0, le=5, description="alternatives per token")
    echo: bool | None = Field(False, description="the prompt in front of the text (and its logprobs)")
    response_format: ResponseFormat | None = None


# ---- SGLang's /generate -----------------------------------------------------------------------------
class GenerateSampling(_Closed):
    """`sampling_params` of /generate: SGLang's names; unknown keys are refused."""

    temperature: float | None = Field(None, ge=0, le=100, description="0 = greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None, description="-1 = off")
    min_p: float | None = Field(None, ge=0, le=1)
    max_new_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS)
    min_new_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS, description="at most max_new_tokens")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=0, lt=2**63)
    skip_special_tokens: bool | None = None
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    logit_bias: LogitBias | None = None
    n: int | None = Field(None, ge=1, le=MAX_N, description=f"1..{MAX_N} choices: the answer is then a list of n "
                                                            "results, each streamed result carries its index")
    json_schema: Grammar | dict[str, Any] | None = Field(None, description="structured output: at most one of "
                                                                          "json_schema, regex, ebnf")
    regex: Grammar | None = None
    ebnf: Grammar | None = None
    no_stop_trim: Literal[False] | None = None  # accepted only at their neutral value
    spaces_between_special_tokens: Literal[True] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None


class SessionParams(_Closed):
    """`session_params` of /generate (SGLang's): continue a request of an open session."""

    id: CacheKey = Field(description="the session (POST /open_session)")
    rid: CacheKey | None = Field(None, description="the session's request to continue (default: its last)")
    offset: int | None = Field(None, ge=-1, description="keep that request's tokens (prompt then output) up to "
                                                       "here; -1 or null: all")
    replace: bool | None = Field(None, description="forget the session's other requests")


PROMPT_FIELDS = ("text", "input_ids", "input_embeds")  # /generate takes exactly one of them
Embeds = Annotated[list[Annotated[list[float], Field(min_length=1)]], Field(min_length=1)]


class GenerateRequest(_Open):
    model_config = ConfigDict(json_schema_extra={
        "oneOf": [  # exactly one of text, input_ids and input_embeds (PROMPT_FIELDS)
            {"required": ["text"], "properties": {"text": {"type": "string"}}},
            {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}},
            {"required": ["input_embeds"], "properties": {"input_embeds": {"type": "array"}}}],
        "if": {"required": ["top_logprobs_num"], "properties": {"top_logprobs_num": {"type": "integer", "minimum": 1}}},
        "then": {"required": ["return_logprob"], "properties": {"return_logprob": {"const": True}}}})
    text: NonEmpty | None = Field(None, description="give text, input_ids or input_embeds")
    input_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    sampling_params: GenerateSampling | None = None
    stream: bool | None = False
    return_logprob: bool | None = False
    top_logprobs_num: int | None = Field(0, ge=0, le=20, description="needs return_logprob")
    logprob_start_len: int | None = Field(-1, ge=-1, description="-1: output logprobs only; k: prompt positions "
                                                                 "k.. (k < the prompt's length)")
    rid: str | None = Field(None, min_length=1, max_length=MAX_RID_LEN)
    priority: Priority | None = None
    extra_key: CacheKey | None = Field(None, description="cache salt: cached prefixes are shared only between "
                                                          "requests with the same one")
    routing_key: CacheKey | None = Field(None, description="the router's cache_aware policy sends requests with the "
                                                            "same key to the same worker")
    lora_path: str | None = Field(None, description="the name of a loaded LoRA adapter (--lora-paths, "
                                                    "/load_lora_adapter); 400 when unknown")
    # `session_params` (SessionParams) is checked by the colocated service that keeps sessions
    # (service/sessions.py); it is not in this document, which the PD router serves too (refused there)
    # issue 40 (service/req_features.py checks them: hidden size, vocabulary, limits)
    return_hidden_states: bool | None = Field(None, description="meta_info.hidden_states: the prompt's last-layer "
                                                                "states, then one per output token after the first")
    input_embeds: Embeds | None = Field(None, description="[T][hidden_size] numbers instead of text or input_ids")
    token_ids_logprob: list[TokenId] | None = Field(None, description="logprobs of these ids at every step "
                                                                      "(needs return_logprob)")
    image_data: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1)] | None = Field(
        None, description="vision-language models: image URLs (as chat's image_url), in the order of the "
                          "image placeholders of `text`; a placeholder the prompt lacks is put before it")

    @field_validator("input_embeds", mode="wrap")
    @classmethod
    def _embeds(cls, v: Any, handler: Any) -> Any:
        try:
            return handler(v)  # pydantic-core checks the numbers; a bad body gets service/req_features' words
        except ValidationError:
            rows = isinstance(v, list) and v and all(isinstance(r, list) and r for r in v)
            raise ValueError("'input_embeds' must hold numbers only" if rows else "'input_embeds' must be a "
                             "non-empty list of non-empty rows of numbers (one per position)") from None

    @model_validator(mode="after")
    def _exactly_one(self) -> GenerateRequest:
        if self.input_embeds is not None and (self.text is not None or self.input_ids is not None):
            raise ValueError("'input_embeds' replaces 'text' and 'input_ids': give only one of the three")
        if self.input_embeds is None and (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of 'text', 'input_ids' or 'input_embeds'")
        return self


class AbortRequest(_Open):
    """`POST /abort_request` (a service): which requests to abort."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [  # at least one of them
        {"required": ["rid"], "properties": {"rid": {"type": "string"}}},
        {"required": ["bootstrap_room"], "properties": {"bootstrap_room": {"type": "integer"}}},
        {"required": ["abort_all"], "properties": {"abort_all": {"const": True}}}]})
    rid: str | None = Field(None, min_length=1)
    bootstrap_room: int | None = Field(None, ge=0, le=2**63 - 1)
    abort_all: bool = False

    @model_validator(mode="after")
    def _some(self) -> AbortRequest:
        if self.rid is None and self.bootstrap_room is None and not self.abort_all:
            raise ValueError("give 'rid', 'bootstrap_room' or 'abort_all': true")
        return self


# ---- validation -------------------------------------------------------------------------------------
def validate(model: type[BaseModel], body: Any) -> Any:
    """`model` validated from a parsed JSON body; RequestInvalid with one message on any problem.

    A whole number sent as a float (2.0) where an integer is expected is taken as that integer, as
    JSON Schema, pydantic's lax mode and OpenAI's servers take it: the body is changed in place (the
    services read some fields from it again), and only a body that failed pays for it."""
    for _ in range(4):  # each pass fixes every integral float pydantic reported; nested ones may follow
        try:
            return model.model_validate(body)
        except ValidationError as e:
            if not _whole_numbers(body, e):
                raise RequestInvalid(message(e, model, body)) from None
    return model.model_validate(body)  # not reached for a JSON body (its depth bounds the passes)


WHOLE_MAX = 2**63  # a float this large stays a float (refused as an integer): bodies are forwarded as JSON int64


def whole(v: Any) -> Any:
    """`v` as an int when it is a float holding a whole number (2.0 -> 2) within int64, else `v` unchanged."""
    return int(v) if type(v) is float and v.is_integer() and -WHOLE_MAX <= v < WHOLE_MAX else v


def _whole_numbers(body: Any, e: ValidationError) -> bool:
    """Replace in `body` each integral float pydantic refused as not an integer; whether any was."""
    changed = False
    for err in e.errors(include_url=False, include_context=False):
        v = err.get("input")
        if err["type"] in ("int_type", "literal_error") and whole(v) is not v:
            parent, key = _slot(body, err["loc"])
            if parent is not None and type(parent[key]) is float and parent[key] == v:
                parent[key] = whole(v)
                changed = True
    return changed


def _slot(body: Any, loc: tuple) -> tuple[Any, Any]:
    """(container, key) of the value at pydantic's error location `loc` in `body` (union branch tags
    in `loc` are skipped), or (None, None)."""
    parent, key, cur = None, None, body
    for el in loc:
        if isinstance(cur, dict) and isinstance(el, str) and el in cur:
            parent, key, cur = cur, el, cur[el]
        elif isinstance(cur, list) and isinstance(el, int) and 0 <= el < len(cur):
            parent, key, cur = cur, el, cur[el]
    return parent, key


_WHAT = {"bool_type": "a boolean", "int_type": "an integer", "float_type": "a number", "string_type": "a string",
         "dict_type": "an object", "model_type": "an object", "model_attributes_type": "an object",
         "list_type": "a list"}
_UNIONS = {"prompt": "a string or a list of token ids (one prompt per request)",
           "stop": "a string or a list of strings", "content": "a string or a list of text and image_url parts",
           "tool_choice": "'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
           "top_k": "-1 (off) or an integer >= 1", "json_schema": "a JSON schema (text or object)"}
_BOUNDS = {"greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"), "less_than": ("<", "lt"),
           "less_than_equal": ("<=", "le")}
_ALIAS = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}


def _path(loc: tuple) -> str:
    out = ""
    for el in loc:
        if isinstance(el, int):
            out += f"[{el}]"
        elif el.isidentifier():  # union branch tags ("list[str]", "function-after[...]") are not
            out += f".{el}" if out else el
    return out


def _at(body: Any, loc: tuple) -> Any:
    for el in loc:
        try:
            body = body[el]
        except (KeyError, IndexError, TypeError):
            return None
    return body


def _range(model: type[BaseModel], loc: tuple) -> str | None:
    """'an integer in 1..64' / 'a number in (0, 1]' from the bounds of the field at `loc`."""
    info = None
    for el in loc:
        info = model.model_fields.get(el) if isinstance(el, str) and model is not None else None
        if info is None:
            return None
        model = next((t for t in (info.annotation, *getattr(info.annotation, "__args__", ()))
                      if isinstance(t, type) and issubclass(t, BaseModel)), None)
    if info is None:
        return None
    b = {type(m).__name__: getattr(m, type(m).__name__.lower()) for m in info.metadata
         if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")}
    lo, hi = b.get("Ge", b.get("Gt")), b.get("Le", b.get("Lt"))
    ints = "int" in str(info.annotation) and "float" not in str(info.annotation)
    if lo is None or hi is None:
        return None
    if ints:
        return f"in {lo}..{hi if 'Le' in b else hi - 1}"
    return f"a number in {'[' if 'Ge' in b else '('}{lo}, {hi}{']' if 'Le' in b else ')'}"


def message(e: ValidationError, model: type[BaseModel], body: Any) -> str:
    """One clear message for the first problem pydantic found."""
    errs = e.errors(include_url=False)
    first = errs[0]
    kind, loc = first["type"], first["loc"]
    ctx = first.get("ctx") or {}
    if kind == "value_error":
        error = str(ctx.get("error", first["msg"]))
        where = _path(loc[:-1]) if loc and loc[-1] in ("role", "content") else ""
        return f"{where}.{error}" if where and error.startswith(("role", "content")) else error
    if kind == "json_invalid":
        return f"malformed JSON body: {first['msg']}"
    if not loc:
        return f"request body must be a JSON object, got {type(body).__name__}"
    if loc == ("messages",) and kind in ("list_type", "too_short"):  # the router's words, kept
        return "'messages' must be a non-empty list"
    special = _special(loc, body)
    if special:
        return special
    at = _union_at(errs)
    if at is not None and _at(body, at) in ("", []):
        return f"'{_path(at)}' is empty"
    if at is not None:  # every branch of a union failed: say what the field takes
        return f"'{_path(at)}' must be {_UNIONS[at[-1]]}, got {_show(_at(body, at))}"
    name = _path(loc)
    label = f"'{name}' ({_ALIAS[name]})" if name in _ALIAS else f"'{name}'"
    got = f", got {_show(first['input'])}"
    if kind == "missing":
        return f"{label} is required"
    if kind == "extra_forbidden":
        return f"unknown field {label}"
    if kind in _WHAT:
        return f"{label} must be {_WHAT[kind]}{got}"
    if kind == "literal_error":
        return f"{label} must be {ctx.get('expected')}{got}"
    if kind == "string_pattern_mismatch" and loc[-1] == "[key]":
        return f"'{_path(loc[:-2])}' key {loc[-2]!r} is not a token id"
    if kind in ("too_short", "string_too_short") and ctx.get("min_length") == 1:
        return f"{label} must be a non-empty {'list' if kind == 'too_short' else 'string'}{got}"
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        what = _range(model, loc) or f"{sign} {ctx.get(key)}"
        return f"{label} must be {what}{got}"
    return f"{label}: {first['msg']}{got}"


def _special(loc: tuple, body: Any) -> str | None:
    """The services' own messages for `n`, a batched prompt, a role or a content part they do not take."""
    if loc[-1] == "n":
        return f"'n' (choices per request) must be an integer in 1..{MAX_N}, got {_show(_at(body, loc))}"
    value = _at(body, loc[:1] if loc[0] in ("text", "input_ids") else loc[:3])
    if loc[0] in ("text", "input_ids") and isinstance(value, list) and value and isinstance(value[0], list | str):
        what = "'text' lists" if loc[0] == "text" else "'input_ids'"
        return f"batched {what} are not supported; send one request per prompt"
    if loc[0] == "messages" and len(loc) > 2 and loc[2] == "role":
        return f"messages[{loc[1]}].role must be one of {', '.join(ROLES)}, got {value!r}"
    if loc[0] == "messages" and len(loc) > 2 and loc[2] == "content" and isinstance(value, list):
        for j, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in ("text", "image_url"):
                return f"messages[{loc[1]}].content[{j}]: parts are text or image_url, got {kind!r}"
    return None


def _union_at(errs: list[Any]) -> tuple | None:
    """The location of the first error's union field when each of its branches failed (pydantic then
    reports one error per branch, tagged with the branch's type), else None."""
    loc = errs[0]["loc"]
    for i, el in enumerate(loc[:-1]):
        tag = loc[i + 1]
        branch = isinstance(tag, str) and (not tag.isidentifier() or tag in _PRIMITIVES or tag[0].isupper())
        if el in _UNIONS and branch and sum(x["loc"][: i + 1] == loc[: i + 1] for x in errs) > 1:
            return loc[: i + 1]
    return None


_PRIMITIVES = ("str", "int", "float", "bool", "dict", "list")


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
