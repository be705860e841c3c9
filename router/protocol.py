"""Request/response shapes the router touches: validating client bodies, adding the bootstrap fields,
merging prefill's input logprobs into decode's answer, error bodies and SSE events.

The router forwards bodies as they are (the workers validate sampling parameters); it only checks
what it needs itself: one prompt per request (a request is one bootstrap room), `stream` a bool.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from common.checks import is_int, need
from common.http import (
    PREFILL_HERE_KEY,
    error_body,  # noqa: F401 (the router's modules import it from here)
)

ENDPOINTS = ("/generate", "/v1/completions", "/v1/chat/completions")
DEFAULT_MAX_NEW_TOKENS = 128  # load estimate only, when the request does not say
CHARS_PER_TOKEN = 4  # load estimate only: the router has no tokenizer
LIST_LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
ROUTING_KEY_MAX = 256


class BadRequest(ValueError):
    """A client error; the message goes back in a 400 body."""


@dataclass(frozen=True)
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

    def prefill_body(self, host: str, port: int, room: int) -> dict:
        body = self.decode_body(host, port, room)
        body["stream"] = False  # the router only needs prefill's final status (and input logprobs)
        body.pop("stream_options", None)
        return body

    def decode_body(self, host: str, port: int, room: int, prefill_here: bool = False) -> dict:
        body = {**self.body, "bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
        body.pop(PREFILL_HERE_KEY, None)  # the router's to set, never a client's
        if prefill_here:
            body[PREFILL_HERE_KEY] = True
        return body


def sse_event(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _need(ok: bool, msg: str) -> None:  # common.checks.need, raising the router's 400
    need(ok, msg, BadRequest)


def _is_id_list(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(is_int(i) for i in x)


def _prompt_of(endpoint: str, body: dict) -> str | list[int]:
    if endpoint == "/v1/chat/completions":
        msgs = body.get("messages")
        _need(isinstance(msgs, list) and bool(msgs), "'messages' must be a non-empty list")
        _need(
            all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs),
            "each message must be an object with a string 'role'",
        )
        return "".join(f"{m['role']}:{json.dumps(m.get('content'))}\n" for m in msgs)
    if endpoint == "/v1/completions":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        _need(
            isinstance(prompt, str) or _is_id_list(prompt),
            "'prompt' must be a string or a list of token ids (one prompt per request)",
        )
        return prompt
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None and isinstance(body.get("input_embeds"), list):
        return ""  # issue 40: the workers check the embeddings (forwarded untouched); no prefix to route by
    _need((text is None) != (ids is None), "give exactly one of 'text' and 'input_ids'")
    _need(
        isinstance(text, str) or _is_id_list(ids),
        "'text' must be a string or 'input_ids' a list of token ids (one prompt per request)",
    )
    return text if text is not None else ids


def _max_new_tokens(endpoint: str, body: dict) -> int:
    if endpoint == "/generate":
        sp = body.get("sampling_params") or {}  # null: none given
        _need(isinstance(sp, dict), "'sampling_params' must be an object")
        value = sp.get("max_new_tokens")
        name = "sampling_params.max_new_tokens"
    else:
        name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        value = body.get(name)
    if value is None:
        return DEFAULT_MAX_NEW_TOKENS
    _need(
        is_int(value) and value >= 0,
        f"'{name}' must be a non-negative integer",
    )
    return value


def parse_request(endpoint: str, body: Any) -> ProxyRequest:
    """Validate what the router needs and build the ProxyRequest (BadRequest on client errors)."""
    _need(isinstance(body, dict), "request body must be a JSON object")
    stream = body.get("stream")
    stream = False if stream is None else stream  # null: not given, as the document allows
    _need(isinstance(stream, bool), "'stream' must be true or false")
    prompt = _prompt_of(endpoint, body)
    prefix = prompt if isinstance(prompt, str) else ",".join(map(str, prompt))
    prefix = _routing(body) or prefix
    tokens = len(prompt) if isinstance(prompt, list) else max(1, len(prompt) // CHARS_PER_TOKEN)
    if endpoint == "/generate":  # SGLang: logprob_start_len -1 (the default) asks for no prompt logprobs
        start = body.get("logprob_start_len")
        input_lp = bool(body.get("return_logprob")) and isinstance(start, int) and start >= 0
    else:
        input_lp = (
            endpoint == "/v1/completions" and bool(body.get("echo")) and body.get("logprobs") is not None
        )
    return ProxyRequest(
        endpoint=endpoint,
        body=body,
        stream=stream,
        prefix=prefix,
        prompt_tokens=tokens,
        max_new_tokens=_max_new_tokens(endpoint, body),
        input_logprobs=input_lp,
        n=_choices(endpoint, body),
    )


def _routing(body: dict) -> str:
    """The cache_aware policy's routing string of a request with a `routing_key` (a digest of the key
    alone, so requests with one key land on one worker, issue 40), else "". Sessions are refused:
    a PD pair does not keep a session's history (colocated services do)."""
    _need(body.get("session_params") is None,
          "'session_params': sessions are served by colocated services; a prefill/decode router does not keep "
          "them (send the whole history)")
    key = body.get("routing_key")
    if key is None:
        return ""
    _need(isinstance(key, str) and 0 < len(key) <= ROUTING_KEY_MAX,
          f"'routing_key' must be a non-empty string of at most {ROUTING_KEY_MAX} characters")
    return hashlib.sha256(key.encode()).hexdigest() * 4  # 256 characters: whole prefix-index blocks


def _choices(endpoint: str, body: dict) -> int:
    """The request's `n` as the router needs it (choices stream interleaved, so n > 1 streams are not
    migrated); the services validate it (a bad n is their 400, relayed)."""
    where = body.get("sampling_params") if endpoint == "/generate" else body
    n = where.get("n") if isinstance(where, dict) else None
    return n if is_int(n) and n > 1 else 1


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


def fault_of(obj: Any) -> str:
    """The PD role a worker's error object blames ("prefill" | "decode"), or "" when it blames none."""
    err = obj.get("error") if isinstance(obj, dict) else None
    fault = err.get("fault") if isinstance(err, dict) else None
    return fault if fault in ("prefill", "decode") else ""


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
