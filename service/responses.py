"""Response bodies: one `RequestTracker` per request collects the worker's TokenOuts, and the
builders below turn it into native (/generate) or OpenAI (completions, chat) JSON and SSE chunks.

Streaming conventions:
  /generate              each chunk carries the cumulative `text` and `output_ids` (SGLang style)
  /v1/completions, chat  each chunk carries only the new text (OpenAI deltas)
Every stream ends with `data: [DONE]`; an error mid-stream is `data: {"error": {...}}` first.
For the router (ParsedRequest.token_ids) each stream event with tokens ends with
`"pd_token_ids": [...]`: the ids consumed since the previous event. A resumed stream
(ParsedRequest.resumed) primes the detokenizer with the ids already streamed, so its text continues
exactly where the first decode's stopped (/generate: its cumulative text and output_ids include
them); usage counts those ids as output, not prompt.
n > 1 (ParsedRequest.choices): one tracker per choice, fed by TokenOut.index. OpenAI bodies list
every choice (`index` 0..n-1), stream chunks carry their choice's `index`, usage counts the prompt
once and the completion tokens of all choices (one usage chunk at the end of a stream); /generate
answers a list of n results (SGLang), and each streamed result carries `index`.
Chat with tools (service/tools.py): a reply that is a tool call becomes `message.tool_calls` (content
null, finish_reason "tool_calls"); streamed, its text is held back while it may be a call and sent as
one `delta.tool_calls` chunk.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from common.http import TOKEN_IDS_KEY
from service.logprob_views import Entry, Pieces, chat_content, completion_logprobs, native_lists, prompt_entries
from service.messages import TokenOut
from service.protocol import ParsedRequest
from service.reasoning import ReasoningSplitter, split
from service.req_features import FeatureLog
from service.tokenizer import TextStream, Tokenizer
from service.tools import may_be_call, parse_call

DONE = b"data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class RequestTracker:
    """State of one request in the frontend: text so far, ids, logprobs, timings, finish."""

    def __init__(self, parsed: ParsedRequest, tok: Tokenizer, t_arrival: float, index: int = 0) -> None:
        self.parsed = parsed
        self.index = index  # the choice (n > 1)
        self.tok = tok
        self.text = TextStream(tok, parsed.stop, parsed.skip_special_tokens)
        self.output_ids: list[int] = []
        self.piece = Pieces(tok)
        self.entries: list[Entry] = []  # output tokens' logprobs, when asked (service.logprob_views)
        self.pending_lp: list[Entry] = []  # the entries not yet sent in a chunk
        self.prompt_lp: list[Entry] | None = None  # prompt tokens' logprobs, when computed by this worker
        self.offset = len(parsed.echo or "")  # completions: text offset of the next streamed token
        self.pending_ids: list[int] = []  # ids not yet sent in a chunk (parsed.token_ids)
        self.resumed = len(parsed.resumed)
        if parsed.resumed:
            self.text.push(parsed.resumed)  # already shown by the stream this one continues
        self.t_arrival = t_arrival
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.itls: list[float] = []
        self.finished = False
        self.released = False  # the frontend has dropped its queue and in-flight count
        self.finish_reason: str | None = None
        self.matched_stop: str | int | None = None
        self.error: str | None = None
        self.error_code = 0
        self.fault = ""  # PD role to blame for the error when it was the peer's (see TokenOut.fault)
        self.retry_after = 0  # an overload error's Retry-After, seconds (see TokenOut.retry_after)
        self.prompt_tokens = len(parsed.req.input_ids) - self.resumed
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.span: Any = None  # this request's frontend span while tracing is on (common.tracing)
        self.call: dict[str, Any] | None = None  # chat with tools: the reply's tool call, once finished
        self.held = ""  # streamed chat with tools: text held back while it may still be a tool call
        self.holding = parsed.tools is not None
        self.extras = FeatureLog()  # hidden states, token_ids_logprob (service.req_features)
        self.reasoning = ReasoningSplitter(parsed.reasoning) if parsed.reasoning else None
        if self.reasoning is not None and parsed.resumed:  # a migrated stream continues the split
            self.reasoning.push(self.text.text)

    @property
    def rid(self) -> str:
        return self.parsed.req.rid

    def consume(self, out: TokenOut) -> str:
        """Apply one TokenOut; returns the new text that is safe to show."""
        if self.parsed.echo_only:  # max_tokens 0: the token generated is not part of the answer
            out = dataclasses.replace(out, new_token_ids=[], new_logprobs=[], new_top_logprobs=[],
                                      completion_tokens=0, finish_reason="length" if out.finish_reason == "stop"
                                      else out.finish_reason, matched_stop=None)
        now = time.perf_counter()
        if out.new_token_ids:
            if self.t_first is None:
                self.t_first = now
            elif self.t_last is not None:
                self.itls.append((now - self.t_last) / len(out.new_token_ids))
            self.t_last = now
        self.output_ids += out.new_token_ids
        self.pending_ids += out.new_token_ids
        if self.parsed.logprobs and out.new_logprobs:
            tops = out.new_top_logprobs or [None] * len(out.new_logprobs)
            new = list(zip(out.new_token_ids, out.new_logprobs, tops))
            self.entries += new
            self.pending_lp += new
        if out.input_start >= 0:
            self.prompt_lp = prompt_entries(self.parsed.req.input_ids, out.input_start, out.input_logprobs,
                                            out.input_top_logprobs)
        self.extras.consume(out)
        delta = self.text.push(out.new_token_ids)
        if out.finished:
            self.finished = True
            self.finish_reason = out.finish_reason or "stop"
            self.matched_stop = out.matched_stop
            self.error, self.error_code, self.fault = out.error, out.error_code, out.fault
            self.retry_after = out.retry_after
            self.prompt_tokens = out.prompt_tokens - self.resumed if out.prompt_tokens else self.prompt_tokens
            self.completion_tokens = (out.completion_tokens or len(self.output_ids)) + self.resumed
            self.cached_tokens = out.cached_tokens
            delta += self.text.finish(out.matched_stop)
            if self.parsed.tools is not None and self.finish_reason == "stop":
                self.call = parse_call(self.content_text(), self.parsed.tools)
        return delta

    def content_text(self) -> str:
        """The reply's text without its reasoning (--reasoning-parser), else all of it."""
        return self.text.text if not self.parsed.reasoning else split(self.text.text, self.parsed.reasoning)[1]

    @property
    def failed(self) -> bool:
        return self.finish_reason in ("error", "abort")

    def error_status(self) -> int:
        if self.error_code >= 400:
            return self.error_code
        return 499 if self.finish_reason == "abort" else 500

    def error_message(self) -> str:
        return self.error or ("request aborted" if self.finish_reason == "abort" else "generation failed")

    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_arrival

    def e2e(self) -> float:
        return time.perf_counter() - self.t_arrival

    def usage(self) -> dict[str, Any]:
        n = self.completion_tokens or len(self.output_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
                "total_tokens": self.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def take_logprobs(self) -> list[Entry]:
        lp, self.pending_lp = self.pending_lp, []
        return lp

    def output_entries(self, entries: list[Entry]) -> list[Entry]:
        """A prefill leaves the output tokens' logprobs to its decode (the router joins the two)."""
        return [] if self.parsed.role == "prefill" else entries


def _finish_obj(tr: RequestTracker) -> dict[str, Any] | None:
    if not tr.finished:
        return None
    if tr.finish_reason == "length":  # `message`: why, when a server limit (the KV pool) ended it
        return {"type": "length", "length": len(tr.output_ids), **({"message": tr.error} if tr.error else {})}
    return {"type": tr.finish_reason, "matched": tr.matched_stop}


def native_body(tr: RequestTracker) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": tr.rid, "finish_reason": _finish_obj(tr), "prompt_tokens": tr.prompt_tokens,
        "completion_tokens": tr.completion_tokens if tr.finished else tr.resumed + len(tr.output_ids),
        "cached_tokens": tr.cached_tokens, "e2e_latency": round(tr.e2e(), 6),
    }
    if tr.parsed.req.pd.room is not None:
        meta["bootstrap_room"] = tr.parsed.req.pd.room
    if tr.parsed.logprobs:
        top = tr.parsed.top_logprobs > 0
        meta.update(native_lists(tr.entries, "output", top))
        meta.update(native_lists(tr.prompt_lp or [], "input", top))
    meta.update(tr.extras.meta(tr.parsed, tr.finished))
    # cumulative: a resumed stream's text and ids include what the stream it continues showed
    body = {"text": tr.text.text, "output_ids": tr.parsed.resumed + tr.output_ids, "meta_info": meta}
    if tr.parsed.choices > 1:
        body["index"] = tr.index
    return body


def _openai_finish(tr: RequestTracker) -> str | None:
    if not tr.finished:
        return None
    if tr.call is not None:
        return "tool_calls"
    return "length" if tr.finish_reason == "length" else "stop"


def _release_held(tr: RequestTracker, delta: str) -> str:
    """Streamed chat with tools: the text to show now. Held back while it may be a tool call (all of
    it for required/named); once it cannot be, or the reply ended without a call, released."""
    tr.held += delta
    if tr.call is not None:
        return ""
    if not tr.finished and tr.holding and (tr.parsed.tools.constrained or may_be_call(tr.held)):
        return ""
    tr.holding = False
    out, tr.held = tr.held, ""
    return out


def _completion_logprobs(tr: RequestTracker, prompt: list[Entry], out: list[Entry]) -> dict[str, Any]:
    """Prompt tokens (echo) at offset 0, output tokens from tr.offset on (advanced past them)."""
    body, _ = completion_logprobs(tr.piece, prompt, 0)
    more, tr.offset = completion_logprobs(tr.piece, tr.output_entries(out), tr.offset)
    return {k: v + more[k] for k, v in body.items()}


def _chat_logprobs(tr: RequestTracker, entries: list[Entry]) -> dict[str, Any]:
    return {"content": chat_content(tr.piece, tr.output_entries(entries))}


def _head(tr: RequestTracker, obj: str) -> dict[str, Any]:
    prefix = "chatcmpl-" if tr.parsed.kind == "chat" else "cmpl-"
    return {"id": tr.parsed.response_id or prefix + tr.rid, "object": obj, "created": tr.parsed.created,
            "model": tr.parsed.model}


def openai_body(tr: RequestTracker) -> dict[str, Any]:
    lp = tr.parsed.logprobs
    if tr.parsed.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": tr.text.text}
        if tr.parsed.reasoning:  # --reasoning-parser: content without the thinking (vLLM/SGLang's shape)
            think, content = split(tr.text.text, tr.parsed.reasoning)
            message = {"role": "assistant", "content": content, "reasoning_content": think or None}
        if tr.call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [tr.call]}
        choice: dict[str, Any] = {"index": tr.index, "message": message,
                                  "logprobs": _chat_logprobs(tr, tr.entries) if lp else None,
                                  "finish_reason": _openai_finish(tr)}
        body = _head(tr, "chat.completion")
    else:
        tr.offset = len(tr.parsed.echo or "")
        choice = {"index": tr.index, "text": (tr.parsed.echo or "") + tr.text.text,
                  "logprobs": _completion_logprobs(tr, tr.prompt_lp or [], tr.entries) if lp else None,
                  "finish_reason": _openai_finish(tr)}
        body = _head(tr, "text_completion")
    body["choices"] = [choice]
    body["usage"] = tr.usage()
    return body


def usage_of(trs: list[RequestTracker]) -> dict[str, Any]:
    """Usage of a request's choices: the prompt once (it is computed once), completions summed."""
    usage = trs[0].usage()
    done = sum(t.completion_tokens or len(t.output_ids) for t in trs)
    usage.update(completion_tokens=done, total_tokens=usage["prompt_tokens"] + done)
    return usage


def final_body(tr: RequestTracker) -> dict[str, Any]:
    return native_body(tr) if tr.parsed.kind == "generate" else openai_body(tr)


def choices_body(trs: list[RequestTracker]) -> Any:
    """The answer of a finished request of len(trs) choices: one body (OpenAI: every choice in
    `choices`), or for /generate with n > 1 a list of n bodies (SGLang's answer)."""
    if len(trs) == 1:
        return final_body(trs[0])
    if trs[0].parsed.kind == "generate":
        return [native_body(t) for t in trs]
    body = openai_body(trs[0])
    if len(trs) > 1:
        body["choices"] = [openai_body(t)["choices"][0] for t in trs]
        body["usage"] = usage_of(trs)
    return body


def usage_chunk(trs: list[RequestTracker]) -> bytes:
    """The last event of a stream with include_usage (no choices, the whole request's usage)."""
    tr = trs[0]
    body = _head(tr, "chat.completion.chunk" if tr.parsed.kind == "chat" else "text_completion")
    body["choices"] = []
    body["usage"] = usage_of(trs)
    return sse(body)


def _echo_chunk(tr: RequestTracker) -> bytes:
    """A streamed completion with echo starts with the prompt text (and its logprobs when this worker
    computed them; in PD the router puts the prefill's in front of this event's lists)."""
    body = _head(tr, "text_completion")
    lp = completion_logprobs(tr.piece, tr.prompt_lp or [], 0)[0] if tr.parsed.logprobs else None
    body["choices"] = [{"index": tr.index, "text": tr.parsed.echo, "logprobs": lp, "finish_reason": None}]
    return sse(body)


def _reasoning_chunk(tr: RequestTracker, think: str) -> bytes:
    body = _head(tr, "chat.completion.chunk")
    body["choices"] = [{"index": tr.index, "delta": {"reasoning_content": think}, "logprobs": None,
                        "finish_reason": None}]
    if tr.parsed.token_ids:
        body[TOKEN_IDS_KEY], tr.pending_ids = tr.pending_ids, []
    return sse(body)


def stream_chunks(tr: RequestTracker, delta: str, first: bool) -> list[bytes]:
    """SSE events for one step of a streamed request (maybe none)."""
    kind = tr.parsed.kind
    if kind == "generate":
        if not delta and not tr.finished and not (tr.parsed.logprobs and tr.pending_lp):
            return []
        tr.take_logprobs()
        body = native_body(tr)
        if tr.parsed.token_ids:
            body[TOKEN_IDS_KEY], tr.pending_ids = tr.pending_ids, []
        return [sse(body)]
    out: list[bytes] = []
    if kind == "chat" and first and not tr.resumed:
        head = _head(tr, "chat.completion.chunk")
        head["choices"] = [{"index": tr.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}]
        out.append(sse(head))
    if kind == "completion" and first and tr.parsed.echo is not None:
        out.append(_echo_chunk(tr))
    if kind == "chat" and tr.reasoning is not None:
        think, delta = tr.reasoning.push(delta, tr.finished)
        if think:  # its own delta, before the content's
            out.append(_reasoning_chunk(tr, think))
    if kind == "chat" and tr.parsed.tools is not None:
        delta = _release_held(tr, delta)
    if not delta and not tr.finished:
        return out
    pairs = tr.take_logprobs() if tr.parsed.logprobs else []
    if kind == "chat":
        body = _head(tr, "chat.completion.chunk")
        choice: dict[str, Any] = {"index": tr.index, "delta": {"content": delta} if delta else {},
                                  "logprobs": _chat_logprobs(tr, pairs) if pairs else None}
        if tr.call is not None:  # the whole call in one delta (OpenAI clients accumulate deltas by index)
            choice["delta"] = {"tool_calls": [{"index": 0, **tr.call}]}
    else:
        body = _head(tr, "text_completion")
        choice = {"index": tr.index, "text": delta,
                  "logprobs": _completion_logprobs(tr, [], pairs) if pairs else None}
    choice["finish_reason"] = _openai_finish(tr)
    body["choices"] = [choice]
    if tr.parsed.token_ids:
        body[TOKEN_IDS_KEY], tr.pending_ids = tr.pending_ids, []
    out.append(sse(body))
    if tr.finished and tr.parsed.include_usage and tr.parsed.choices == 1:  # n > 1: after the last choice
        out.append(usage_chunk([tr]))
    return out
