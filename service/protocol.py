"""HTTP request parsing and validation, the one parse of a request: JSON bodies -> `ParsedRequest`
(a typed, valid GenerateReq + how to answer). The worker trusts it and checks only KV capacity.

Three request kinds share one path:
  generate     native `POST /generate` (SGLang style: text | input_ids, sampling_params dict)
  completion   `POST /v1/completions` (OpenAI)
  chat         `POST /v1/chat/completions` (OpenAI; content is a string or a list of text and image_url parts)

Images (vision-language models: chat's image_url parts, /generate's `image_data`): the parse places one
image token per image and records where (service/image_prompt.py); the frontend then loads, checks and
preprocesses them (service/images.py) and expands each to the image's tokens.

Each body is first validated with the model the OpenAPI document shows (common/api_requests.py:
types, ranges, shapes, one clear message naming the field); then this module checks what no schema
can say: the vocabulary, the context length, grammars that compile, tools, the PD fields.
Every problem raises `RequestError` (HTTP status + message); nothing here touches a process or a
socket, so it is unit-tested directly. Response bodies are built in `service/frontend.py`.

Request options of every endpoint (`priority`, `extra_key` / `cache_salt`, `routing_key`):
service/request_options.py; /generate's `session_params` (colocated only): service/sessions.py.

PD wire format: the router adds `bootstrap_host`, `bootstrap_port`, `bootstrap_room` to the body it
posts to both prefill and decode. They are required on prefill/decode roles, ignored on colocated.

Mid-stream migration (completions and chat; internal fields of the router, common/http.py):
`pd_token_ids: true` asks for each stream event's token ids; `pd_resume: {"output_ids", "id",
"created"}` continues a stream another decode began: the prompt is the request's prompt plus
`output_ids`, max tokens shrink by their count, and the answer keeps the stream's id and created.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from typing import Any

from common.api_requests import (
    AbortRequest,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerateRequest,
    RequestInvalid,
    validate,
    whole,
)
from common.checks import is_int
from common.http import ENCODER_HOST_KEY, ENCODER_PORT_KEY, PREFILL_HERE_KEY, RESUME_KEY, TOKEN_IDS_KEY
from engine.request_groups import COLOCATED, NO_LOGPROBS, Bootstrap, LogprobParams
from engine.sampling.grammar import GrammarError, GrammarSpec
from engine.sampling.params import SamplingParams
from service import image_prompt, req_features, request_options
from service.messages import AbortReq, GenerateReq
from service.parsed import Limits, ParsedRequest, RequestError, parse_json_body
from service.sessions import attach_session, session_prompt
from service.tokenizer import ChatTemplateError
from service.tools import ToolError, parse_tools, render_calls, with_system_prompt

__all__ = ["Limits", "ParsedRequest", "RequestError", "parse_abort", "parse_bootstrap", "parse_chat",
           "parse_completion", "parse_generate", "parse_json_body"]  # the parser's API, types included

DEFAULT_MAX_NEW_TOKENS = 128
MAX_ROOM = 2**63 - 1
MAX_RID_LEN = 256
# OpenAI / SGLang parameters we do not implement: accepted only at their neutral value
NEUTRAL = {"best_of": 1, "no_stop_trim": False, "spaces_between_special_tokens": True,
           "suffix": None}
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class Resume:
    output_ids: list[int]
    response_id: str
    created: int | None


def _resume(body: dict[str, Any], limits: Limits) -> Resume | None:
    raw = body.get(RESUME_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RequestError(f"'{RESUME_KEY}' must be an object")
    ids = _check_ids(raw.get("output_ids"), limits, f"'{RESUME_KEY}.output_ids'")
    rid, created = raw.get("id", ""), raw.get("created")
    if not isinstance(rid, str) or not (created is None or is_int(created)):
        raise RequestError(f"'{RESUME_KEY}': 'id' must be a string, 'created' an integer")
    return Resume(ids, rid, created)


def _resumed(body: dict[str, Any], ids: list[int], sampling: dict[str, Any],
             limits: Limits) -> tuple[list[int], Resume | None]:
    """Prompt ids and sampling of a resumed stream: prompt + output so far, the rest of the budget."""
    resume = _resume(body, limits)
    if resume is None:
        return ids, None
    budget = sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if is_int(budget):
        if budget <= len(resume.output_ids):
            raise RequestError(f"'{RESUME_KEY}' holds {len(resume.output_ids)} tokens: nothing left of "
                               f"max tokens {budget}")
        sampling["max_new_tokens"] = budget - len(resume.output_ids)
    low = sampling.get("min_new_tokens")
    if is_int(low):
        sampling["min_new_tokens"] = max(0, low - len(resume.output_ids))
    return ids + resume.output_ids, resume


def _apply_resume(parsed: ParsedRequest, resume: Resume | None) -> None:
    if resume is not None and parsed.req.n > 1:
        raise RequestError(f"'{RESUME_KEY}' continues one stream; it cannot be combined with 'n' > 1")
    if resume is not None:
        parsed.resumed, parsed.response_id = list(resume.output_ids), resume.response_id
        parsed.req = dataclasses.replace(parsed.req, resumed_tokens=len(resume.output_ids))
        if resume.created is not None:
            parsed.created = resume.created


def _valid(model: type[Any], body: dict[str, Any]) -> Any:
    """The body as its documented model (common/api_requests.py): the one type, range and shape check."""
    try:
        return validate(model, body)
    except RequestInvalid as e:
        raise RequestError(str(e)) from None


def _check_neutral(body: dict[str, Any], where: str) -> None:
    for key, neutral in NEUTRAL.items():
        v = body.get(key)
        if v is None or v == neutral:
            continue
        raise RequestError(f"{where}'{key}'={v!r} is not supported by this server")


def parse_bootstrap(body: dict[str, Any], role: str) -> Bootstrap:
    """The PD group: host, port, room required and validated on prefill/decode (and, on a decode, the
    router's prefill_here hint); all None on colocated."""
    if role == "colocated":
        return COLOCATED
    host, port, room = body.get("bootstrap_host"), whole(body.get("bootstrap_port")), whole(body.get("bootstrap_room"))
    missing = [k for k, v in (("bootstrap_host", host), ("bootstrap_port", port), ("bootstrap_room", room))
               if v is None]
    if missing:
        raise RequestError(f"a {role} service needs {', '.join(missing)} "
                           "(PD requests come through the router)")
    if not isinstance(host, str) or not host or len(host) > 253 or any(c.isspace() for c in host):
        raise RequestError(f"bootstrap_host must be a non-empty host name or address, got {host!r}")
    if not is_int(port) or not 1 <= port <= 65535:
        raise RequestError(f"bootstrap_port must be an integer in 1..65535, got {port!r}")
    if not is_int(room) or not 0 <= room <= MAX_ROOM:
        raise RequestError(f"bootstrap_room must be an integer in 0..2^63-1, got {room!r}")
    return Bootstrap(host, port, room, prefill_here=role == "decode" and body.get(PREFILL_HERE_KEY) is True)


def parse_encoder(body: dict[str, Any], role: str, pd: Bootstrap) -> Bootstrap:
    """E/P/D, on a prefill: the encoder that sends this request's image rows (the router's
    `encoder_bootstrap_host` / `encoder_bootstrap_port`; the room is the request's); COLOCATED when absent."""
    host, port = body.get(ENCODER_HOST_KEY), whole(body.get(ENCODER_PORT_KEY))
    if role != "prefill" or (host is None and port is None):
        return COLOCATED
    if not isinstance(host, str) or not host or len(host) > 253 or any(c.isspace() for c in host):
        raise RequestError(f"encoder_bootstrap_host must be a non-empty host name or address, got {host!r}")
    if not is_int(port) or not 1 <= port <= 65535:
        raise RequestError(f"encoder_bootstrap_port must be an integer in 1..65535, got {port!r}")
    return Bootstrap(host, port, pd.room)


def _rid(body: dict[str, Any]) -> str:
    rid = body.get("rid")
    if rid is None:
        return uuid.uuid4().hex
    if not isinstance(rid, str) or not rid or len(rid) > MAX_RID_LEN:
        raise RequestError(f"'rid' must be a non-empty string of at most {MAX_RID_LEN} characters")
    return rid


def _check_ids(ids: Any, limits: Limits, what: str) -> list[int]:
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise RequestError(f"{what} must be a list of integer token ids")
    return _check_vocab(ids, limits, what)


def _check_vocab(ids: list[int], limits: Limits, what: str) -> list[int]:
    """`ids` (integers, as the request model checked) when each is a token of this model's vocabulary."""
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise RequestError(f"{what} holds token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})")
    return ids


def _sampling(raw: dict[str, Any], prompt_len: int, limits: Limits) -> SamplingParams:
    """SamplingParams from the fields a validated model gave (`raw`: SamplingParams' names, values as
    the model holds them), checked against this model (vocabulary, grammar, context window), with
    max_new_tokens fitted into the context window."""
    ctx = limits.context_length
    if prompt_len == 0:
        raise RequestError("the prompt is empty")
    if prompt_len >= ctx:
        raise RequestError(f"the prompt has {prompt_len} tokens; this model's context length is {ctx} "
                           f"(prompt + output), so at most {ctx - 1} prompt tokens fit")
    try:  # lists as tuples, logit_bias as (id, bias) pairs; a cross-field rule (min_new_tokens <= max) names it
        sp = SamplingParams.from_dict({k: v for k, v in raw.items() if v is not None})
    except ValueError as e:
        raise RequestError(str(e)) from e
    outside = [t for t, _ in sp.logit_bias if t >= limits.vocab_size]
    if outside:
        raise RequestError(f"logit_bias names token id {outside[0]} outside the vocabulary [0, {limits.vocab_size})")
    spec = GrammarSpec.of(sp)
    if spec is not None and limits.grammars is not None:  # compiled (and cached) here: the worker gets none bad
        try:
            limits.grammars.compile(spec)
        except GrammarError as e:
            raise RequestError(str(e)) from e
    return sp.within(ctx - prompt_len)


def _make(kind: str, body: dict[str, Any], ids: list[int], sp: SamplingParams, limits: Limits,
          stream: bool, logprobs: bool, top: int = 0, start: int = -1, n: int = 1) -> ParsedRequest:
    """`top`: alternatives per token, `start`: first prompt position with a logprob (-1: none),
    `n`: choices (the prompt is computed once, engine.scheduling.parallel)."""
    # LoRA adapter by `lora_path` (/generate) or `model` (/v1); service/lora.py
    lora = limits.loras.resolve(kind, body, limits.model_name, limits.role) if limits.loras is not None else ""
    pd = parse_bootstrap(body, limits.role)
    req = GenerateReq(rid=_rid(body), input_ids=ids, sampling=sp, stream=stream,
                      logprobs=LogprobParams(logprobs, top, start) if logprobs else NO_LOGPROBS,
                      options=request_options.options(body, kind, lora),  # priority, cache salt (issue 40)
                      pd=pd, n=n, encoder=parse_encoder(body, limits.role, pd))
    return ParsedRequest(kind=kind, req=req, model=lora or limits.model_name, stop=sp.stop,
                         skip_special_tokens=sp.skip_special_tokens, logprobs=logprobs,
                         top_logprobs=top if logprobs else 0, role=limits.role,
                         token_ids=body.get(TOKEN_IDS_KEY) is True)


def _generate_logprobs(m: GenerateRequest, prompt_len: int) -> tuple[bool, int, int]:
    """SGLang's (return_logprob, top_logprobs_num, logprob_start_len); -1 (the default) reports no
    prompt logprobs, k >= 0 those of prompt positions k.. (position 0's value is null)."""
    logprobs, top = bool(m.return_logprob), m.top_logprobs_num or 0
    if top and not logprobs:
        raise RequestError("'top_logprobs_num' needs 'return_logprob': true")
    start = -1 if m.logprob_start_len is None else m.logprob_start_len
    if not -1 <= start < prompt_len:
        raise RequestError(f"'logprob_start_len' must be -1 (output only) or a prompt position in "
                           f"0..{prompt_len - 1}, got {start}")
    return logprobs, top, start


def parse_generate(body: dict[str, Any], tok: Any, limits: Limits) -> ParsedRequest:
    """Native /generate: `text` xor `input_ids`, `sampling_params`, `stream`, `return_logprob`, `rid`."""
    m = _valid(GenerateRequest, body)
    embeds = req_features.input_embeds(body, limits)  # [T, H] instead of text or ids (issue 40)
    ids = (embeds[0] if embeds else _check_vocab(tok.encode(m.text), limits, "'text' (tokenized)")
           if m.text is not None else _check_vocab(m.input_ids, limits, "'input_ids'"))
    urls = [m.image_data] if isinstance(m.image_data, str) else list(m.image_data or ())
    if urls:
        if limits.image_tokens is None:
            raise image_prompt.no_images("'image_data'")
        if embeds or body.get("session_params") is not None or (m.logprob_start_len or -1) >= 0:
            raise RequestError("'image_data' cannot be combined with 'input_embeds', 'session_params' or prompt "
                               "logprobs ('logprob_start_len' >= 0)")
        ids = image_prompt.with_placeholders(ids, len(urls), limits)
    ids, session = session_prompt(body, ids, limits.sessions, limits.role)  # a session's history first
    given = m.sampling_params  # GenerateSampling: SamplingParams' names, plus n and the neutral ones
    n = (given and given.n) or 1
    sp_raw = {} if given is None else {k: v for k in SAMPLING_FIELDS if (v := getattr(given, k)) is not None}
    stream = bool(m.stream)
    logprobs, top, start = _generate_logprobs(m, len(ids))
    ids, resume = _resumed(body, ids, sp_raw, limits)
    sp = _sampling(sp_raw, len(ids), limits)
    parsed = _make("generate", body, ids, sp, limits, stream, logprobs, top, start, n)
    _apply_resume(parsed, resume)
    attach_session(parsed, session)
    req_features.apply(parsed, body, embeds, limits)  # hidden states, input_embeds, token_ids_logprob
    if urls:
        image_prompt.locate(parsed, urls, limits)
    return parsed


_OPENAI_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "stop_token_ids",
                    "skip_special_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty",
                    "logit_bias")


def _openai_sampling_raw(m: ChatCompletionRequest | CompletionRequest,
                         max_key_order: tuple[str, ...]) -> dict[str, Any]:
    """SamplingParams fields from a validated OpenAI body (SGLang's names)."""
    raw: dict[str, Any] = {k: v for k in _OPENAI_SAMPLING if (v := getattr(m, k)) is not None}
    if m.min_tokens is not None:  # vLLM's and SGLang's OpenAI extension
        raw["min_new_tokens"] = m.min_tokens
    for key in max_key_order:
        if (v := getattr(m, key)) is not None:
            raw["max_new_tokens"] = v
            break
    if m.stop is not None:  # OpenAI ignores empty stop strings
        raw["stop"] = [s for s in ([m.stop] if isinstance(m.stop, str) else m.stop) if s]
    return raw


def _response_format(m: ChatCompletionRequest | CompletionRequest) -> dict[str, str]:
    """OpenAI's response_format as a sampling grammar: text (none), json_object (any JSON object) or
    json_schema (its `schema`; replies always follow it, strict or not)."""
    rf = m.response_format
    if rf is None or rf.type == "text":
        return {}
    if rf.type == "json_object":
        return {"json_schema": '{"type": "object"}'}
    return {"json_schema": json.dumps(rf.json_schema.schema_)}  # type json_schema: the model checked it


def _stream_opts(m: ChatCompletionRequest | CompletionRequest) -> tuple[bool, bool]:
    return bool(m.stream), bool(m.stream_options and m.stream_options.include_usage)


def parse_completion(body: dict[str, Any], tok: Any, limits: Limits) -> ParsedRequest:
    """OpenAI /v1/completions: prompt is a string or a list of token ids (one prompt only)."""
    _check_neutral(body, "")
    m = _valid(CompletionRequest, body)
    prompt = m.prompt
    if isinstance(prompt, list) and isinstance(prompt[0], str | list):  # one prompt in a list
        prompt = prompt[0]
    ids = _check_vocab(tok.encode(prompt) if isinstance(prompt, str) else prompt, limits, "'prompt'")
    lp, echo = m.logprobs, bool(m.echo)
    stream, include_usage = _stream_opts(m)
    raw = _openai_sampling_raw(m, ("max_tokens",)) | _response_format(m)
    echo_only = echo and raw.get("max_new_tokens") == 0 and RESUME_KEY not in body
    if echo_only:  # scoring a prompt (eval harnesses): one token is generated and never shown
        raw["max_new_tokens"], raw["min_new_tokens"] = 1, 0
    ids, resume = _resumed(body, ids, raw, limits)
    sp = _sampling(raw, len(ids), limits)
    echo = echo and resume is None  # a resumed stream's first leg already showed the prompt
    # echo + logprobs: the prompt's tokens too (the first one's logprob is null, as OpenAI's)
    parsed = _make("completion", body, ids, sp, limits, stream, lp is not None, lp or 0, 0 if echo else -1,
                   m.n or 1)
    parsed.include_usage = include_usage
    parsed.echo_only = echo_only
    if echo:
        parsed.echo = prompt if isinstance(prompt, str) else tok.decode(ids, skip_special_tokens=False)
    _apply_resume(parsed, resume)
    return parsed


def _message_text(i: int, msg: ChatMessage, raw: dict[str, Any], urls: list[str]) -> dict[str, Any]:
    """One validated message (`raw`: its JSON object) as template input: text parts joined, an
    assistant's earlier tool calls rendered, developer as system. A message with image parts keeps its
    parts (text, and {"type": "image"} where each image goes, as vision models' templates take them) and
    adds the images' URLs to `urls`."""
    role, content = msg.role, msg.content
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list) and any(part.type == "image_url" for part in content):
        parts: list[dict[str, str]] = []
        for part in content:
            if part.type == "image_url":
                urls.append(part.image_url.url)
                parts.append({"type": "image"})
            else:
                parts.append({"type": "text", "text": part.text})
        return {"role": "system" if role == "developer" else role, "content": parts}
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    if role == "assistant" and msg.tool_calls:  # earlier calls, in the documented text format
        try:
            calls = render_calls(raw["tool_calls"])
        except ToolError as e:
            raise RequestError(f"messages[{i}]: {e}") from e
        content = (content + "\n" if content else "") + calls
    if content is None:
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def parse_chat(body: dict[str, Any], tok: Any, limits: Limits) -> ParsedRequest:
    """OpenAI /v1/chat/completions."""
    _check_neutral(body, "")
    m = _valid(ChatCompletionRequest, body)
    urls: list[str] = []
    messages = [_message_text(i, msg, raw, urls) for i, (msg, raw) in enumerate(zip(m.messages, body["messages"]))]
    if not any(m["content"] for m in messages):
        raise RequestError("every message is empty")
    if urls and limits.image_tokens is None:
        raise image_prompt.no_images("'messages' holds image_url parts")
    try:
        plan = parse_tools(body)
    except ToolError as e:
        raise RequestError(str(e)) from e
    grammar = _response_format(m)
    if plan is not None and plan.constrained:
        if grammar:
            raise RequestError("'response_format' and a required or named 'tool_choice' cannot be combined")
        grammar = {"json_schema": plan.call_schema()}
    logprobs, top = bool(m.logprobs), m.top_logprobs
    if top is not None and not logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true")
    stream, include_usage = _stream_opts(m)
    try:
        if plan is not None and getattr(tok, "template_takes_tools", False):
            ids = tok.apply_chat_template(messages, tools=plan.for_template())
        else:
            ids = tok.apply_chat_template(messages if plan is None else with_system_prompt(messages, plan))
    except ChatTemplateError as e:
        raise RequestError(str(e)) from e
    _check_vocab(ids, limits, "'messages' (tokenized)")  # a tokenizer larger than the model's vocabulary
    raw = _openai_sampling_raw(m, ("max_completion_tokens", "max_tokens")) | grammar
    ids, resume = _resumed(body, ids, raw, limits)
    sp = _sampling(raw, len(ids), limits)
    parsed = _make("chat", body, ids, sp, limits, stream, logprobs, top or 0, n=m.n or 1)
    parsed.include_usage = include_usage
    parsed.tools = plan
    _apply_resume(parsed, resume)
    if urls:
        image_prompt.locate(parsed, urls, limits)
    return parsed


def parse_abort(body: dict[str, Any]) -> AbortReq:
    """`{"rid": str}`, `{"bootstrap_room": int}` or `{"abort_all": true}` (common.api_requests.AbortRequest)."""
    m = _valid(AbortRequest, body)
    return AbortReq(rid=m.rid or "", room=m.bootstrap_room, abort_all=m.abort_all)
