"""Request/response shapes the router touches: validating client bodies, adding the bootstrap fields,
merging prefill's input logprobs into decode's answer, error bodies and SSE events.

A client body is validated with the model the services parse it with and the OpenAPI document shows
(common/api_requests.py: types, ranges, shapes, one message naming the field), so a body the router
passes is one the services take, bar what only a worker knows (its vocabulary, its context length,
grammars that compile). The router adds its own rules (sessions: a PD pair keeps none) and reads what it
needs from the validated model: the prompt (for cache_aware and the load estimate), max tokens, n, stream,
and whether the request carries images (then an encoder may run them: router/proxy.py, E/P/D).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import orjson

from common.api_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    RequestInvalid,
    validate,
)
from common.checks import need
from common.http import (
    ENCODER_HOST_KEY,
    ENCODER_PORT_KEY,
    PREFILL_HERE_KEY,
    error_body,  # noqa: F401 (the router's modules import it from here)
)
from router.kv_index import ExactPrompt

MODELS = {"/generate": GenerateRequest, "/v1/completions": CompletionRequest,
          "/v1/chat/completions": ChatCompletionRequest}
ENDPOINTS = tuple(MODELS)
DEFAULT_MAX_NEW_TOKENS = 128  # load estimate only, when the request does not say
CHARS_PER_TOKEN = 4  # estimates only (load, the tie-break of a tree): the KV events tokenizer is not on this path
LIST_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
# E/P/D: where the prefill reaches the encoder that sends it the request's image embeddings (same room).
# Set by the router only (on the prefill's body, when it picked an encoder), stripped from client bodies.
ROLES = ("prefill", "decode", "encoder")  # what a worker's error may blame (`error.fault`)


class BadRequest(ValueError):
    """A client error; the message goes back in a 400 body."""


@dataclass(slots=True)  # not frozen: built once per request on the hot path (a frozen init costs ~3x); never changed
class ProxyRequest:
    endpoint: str
    body: dict
    stream: bool
    prefix: str  # prompt text (or ids) used by cache_aware
    prompt_tokens: int  # estimate
    max_new_tokens: int  # estimate
    input_logprobs: bool  # prefill's input logprobs go in front of decode's
    n: int = 1  # choices (the decode streams them interleaved, each event with its index)
    trace: Any = None  # the request's span while tracing is on (common.tracing), else None
    exact: ExactPrompt | None = None  # token ids (+ salt, adapter) for exact KV index lookups: a token-id prompt's,
    # or a text/chat prompt's as the router tokenized it (router/prompt_ids.py, Proxy.with_prompt_ids)
    images: bool = False  # chat image_url parts or /generate image_data: an encoder may run them (E/P/D)

    def prefill_body(self, host: str, port: int, room: int, encoder: tuple[str, int] | None = None) -> dict:
        """P's body: D's with `stream: false`; with `encoder` (E's bootstrap host and port) the prefill
        receives the request's image embeddings from that encoder (same room)."""
        body = self.decode_body(host, port, room)
        body["stream"] = False  # the router only needs prefill's final status (and input logprobs)
        body.pop("stream_options", None)
        if encoder is not None:
            body[ENCODER_HOST_KEY], body[ENCODER_PORT_KEY] = encoder
        return body

    def encoder_body(self, host: str, port: int, room: int) -> dict:
        """E's body: the request as P gets it (`stream: false`), with E's own bootstrap server and the room."""
        return self.prefill_body(host, port, room)

    def decode_body(self, host: str, port: int, room: int, prefill_here: bool = False) -> dict:
        body = {**self.body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
        body.pop(PREFILL_HERE_KEY, None)  # the router's to set, never a client's
        if ENCODER_HOST_KEY in body or ENCODER_PORT_KEY in body:  # likewise (a client naming a host to connect to)
            body.pop(ENCODER_HOST_KEY, None)
            body.pop(ENCODER_PORT_KEY, None)
        if prefill_here:
            body[PREFILL_HERE_KEY] = True
        return body


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _need(ok: bool, msg: str) -> None:  # common.checks.need, raising the router's 400
    need(ok, msg, BadRequest)


def parse_request(endpoint: str, body: Any) -> ProxyRequest:
    """Validate `body` with the endpoint's request model and build the ProxyRequest (BadRequest on
    client errors, with the services' message)."""
    model = MODELS[endpoint]
    try:
        m = model.model_validate(body)  # the common case; a refused body goes through validate() for its message
    except ValueError:
        try:
            m = validate(model, body)
        except RequestInvalid as e:
            raise BadRequest(str(e)) from None
    _need(body.get("session_params") is None,
          "'session_params': sessions are served by colocated services; a prefill/decode router does not keep "
          "them (send the whole history)")
    prompt = _prompt_of(m, body)
    prefix = prompt if isinstance(prompt, str) else ",".join(map(str, prompt))
    tokens = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // CHARS_PER_TOKEN)
    if endpoint == "/generate":  # SGLang: logprob_start_len -1 (the default) asks for no prompt logprobs
        sp = m.sampling_params
        max_new, n = sp and sp.max_new_tokens, (sp and sp.n) or 1
        input_lp = bool(m.return_logprob) and m.logprob_start_len is not None and m.logprob_start_len >= 0
    elif endpoint == "/v1/completions":
        max_new, n = m.max_tokens, m.n or 1
        input_lp = bool(m.echo) and m.logprobs is not None
    else:
        max_new = m.max_completion_tokens if m.max_completion_tokens is not None else m.max_tokens
        n, input_lp = m.n or 1, False
    return ProxyRequest(
        endpoint=endpoint,
        body=body,
        stream=bool(m.stream),
        prefix=_routing(m.routing_key) or prefix,
        prompt_tokens=tokens,
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new is None else max_new,
        input_logprobs=input_lp,
        n=n,
        exact=None if m.routing_key is not None else _exact(endpoint, prompt, body),
        images=_has_images(endpoint, body),
    )


def _has_images(endpoint: str, body: dict) -> bool:
    """Whether a validated body carries images: a chat message whose content list holds an `image_url` part,
    or /generate's `image_data` (a non-empty string or list). Only the parts' types are read."""
    if endpoint == "/generate":
        return bool(body.get("image_data"))
    if endpoint != "/v1/chat/completions":
        return False
    for msg in body["messages"]:
        content = msg.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") == "image_url":
                    return True
    return False


def _exact(endpoint: str, prompt: str | list[int], body: dict) -> ExactPrompt | None:
    """What the KV index hashes (router/kv_index.py): a token-id prompt, its cache salt and the adapter it
    names; None for a text prompt (router/prompt_ids.py tokenizes those when it can)."""
    if not isinstance(prompt, list) or not prompt or not isinstance(prompt[0], int):
        return None
    return ExactPrompt(prompt, *cache_keys(endpoint, body))


def cache_keys(endpoint: str, body: dict) -> tuple[str, str]:
    """(cache salt, adapter) of a validated body, as the worker's namespace takes them: `extra_key` and
    `cache_salt` (both given and different: joined, as service.request_options does), the adapter by `lora_path`
    (/generate) or `model` (the worker uses it only when it holds that adapter: router/kv_index.py)."""
    salts = [s for s in (body.get("extra_key"), body.get("cache_salt")) if isinstance(s, str)]
    salt = "" if not salts else salts[0] if len(set(salts)) == 1 else "\x1f".join(salts)
    adapter = body.get("lora_path" if endpoint == "/generate" else "model")
    return salt, adapter if isinstance(adapter, str) else ""


def _prompt_of(m: Any, body: dict) -> str | list[int]:
    """The prompt as cache_aware routes by it: text, token ids, or the chat messages as role:content lines (an
    image part by its URL's digest: a data: URL's megabytes of base64 would fill the prefix index and the
    load estimate, and the digest tells images apart as well)."""
    if isinstance(m, ChatCompletionRequest):
        return "".join(f"{msg['role']}:{orjson.dumps(_routed(msg.get('content'))).decode()}\n"
                       for msg in body["messages"])
    if isinstance(m, CompletionRequest):
        prompt = m.prompt
        return prompt[0] if isinstance(prompt, list) and isinstance(prompt[0], str | list) else prompt
    if m.text is not None:
        return m.text
    return m.input_ids if m.input_ids is not None else ""  # input_embeds: no prefix to route by (issue 40)


def _routed(content: Any) -> Any:
    """A chat message's content as routing text sees it: image parts' URLs replaced by their SHA-256."""
    if not isinstance(content, list):
        return content
    return [{"type": "image_url", "image_url": hashlib.sha256(str(
        (p.get("image_url") or {}).get("url", "")).encode()).hexdigest()}
            if isinstance(p, dict) and p.get("type") == "image_url" else p for p in content]


def _routing(key: str | None) -> str:
    """The cache_aware policy's routing string of a request with a `routing_key` (a digest of the key
    alone, so requests with one key land on one worker, issue 40), else ""."""
    if key is None:
        return ""
    return hashlib.sha256(key.encode()).hexdigest() * 4  # 256 characters: whole prefix-index blocks


def merge_input_logprobs(endpoint: str, prefill: dict, decode: Any) -> Any:
    """Put prefill's input logprobs in front of decode's (decode's body is changed and returned).

    /generate: every list under `meta_info` whose key starts with `input_` (n > 1: in each result).
    /v1/completions (echo + logprobs): the lists of each choice's `logprobs`, matched by index (n > 1:
    the prefill answers choice 0 only, the prompt's logprobs are the same for every choice).
    """
    if endpoint == "/generate":
        pm = prefill.get("meta_info") if isinstance(prefill, dict) else None
        for result in decode if isinstance(decode, list) else [decode]:
            dm = result.get("meta_info") if isinstance(result, dict) else None
            if isinstance(pm, dict) and isinstance(dm, dict):
                for key, value in pm.items():
                    if key.startswith("input_") and isinstance(value, list):
                        rest = dm.get(key)
                        dm[key] = value + (rest if isinstance(rest, list) else [])
        return decode
    pchoices = {
        c.get("index", i): c for i, c in enumerate(prefill.get("choices") or []) if isinstance(c, dict)
    }
    for i, choice in enumerate(decode.get("choices") or []):
        pc = pchoices.get(choice.get("index", i), pchoices.get(0)) if isinstance(choice, dict) else None
        plp, dlp = (pc or {}).get("logprobs"), choice.get("logprobs") if isinstance(choice, dict) else None
        if isinstance(plp, dict) and isinstance(dlp, dict):
            for key in LIST_LOGPROB_KEYS:
                if isinstance(plp.get(key), list):
                    dlp[key] = plp[key] + (dlp.get(key) or [])
    return decode


def _error_field(obj: Any, key: str) -> Any:
    """`obj["error"][key]` of a worker's error object, or None."""
    err = obj.get("error") if isinstance(obj, dict) else None
    return err.get(key) if isinstance(err, dict) else None


def fault_of(obj: Any) -> str:
    """The role a worker's error object blames ("prefill" | "decode" | "encoder"), or "" when it blames none."""
    fault = _error_field(obj, "fault")
    return fault if fault in ROLES else ""


def retry_after_of(obj: Any) -> int:
    """The seconds an overloaded worker's error object asks a client to wait (`error.retry_after`, from
    common.http.error_body), or 0 when it names none: only an error with one is an overload refusal."""
    value = _error_field(obj, "retry_after")
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return 0
    return math.ceil(value)


def error_of(obj: Any) -> tuple[int, str] | None:
    """(status, message) when a worker's JSON (body or SSE event) is an error object, else None."""
    if not isinstance(obj, dict) or "error" not in obj:
        return None
    err = obj["error"]
    if isinstance(err, dict):
        code = err.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return status, str(err.get("message", err))
    return 500, str(err)
