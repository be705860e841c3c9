"""Typed messages between a service's frontend process and its worker process.

Every message is a small dataclass. On the wire (zmq over ipc, `service.channels`) it is a msgpack map
with a `type` and a `version` field; `encode`/`decode` are common.codec's one codec (the transfer
messages use it too). An unknown type, a version mismatch or a bad field raises `ValueError` on
decode, never a half-read message.

A GenerateReq is already valid when it is built (the frontend parsed the HTTP body once: sampling
parameters, prompt, bootstrap fields); the worker only checks what only it knows (KV capacity). Its
groups (engine.request_groups) travel as typed maps nested in it, with its version.

Direction frontend -> worker: GenerateReq, AbortReq, CloseSessionReq, StatsReq, FlushCacheReq, LoraReq, EmbedReq.
Direction worker -> frontend: TokenBatch, StatsOut, FlushCacheOut, LoraOut, EmbedOut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.codec import Codec
from engine.request_groups import (
    COLOCATED,
    GROUPS,
    NO_EXTRAS,
    NO_LOGPROBS,
    NO_OPTIONS,
    Bootstrap,
    Extras,
    ImageInput,
    LogprobParams,
    ReqOptions,
)
from engine.sampling.params import SamplingParams
from service.stats import STATS_PARTS, WorkerStats

VERSION = 1


@dataclass
class GenerateReq:
    """A tokenized, validated request (service.protocol builds it; nothing downstream re-parses it).
    Its groups mirror the request's and go into the engine's Req as they are (engine.request_groups):
    `sampling`, `logprobs`, `options` (scheduling and cache), `pd` (bootstrap), `extras`."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    logprobs: LogprobParams = NO_LOGPROBS
    options: ReqOptions = NO_OPTIONS  # priority, cache salt, session, LoRA adapter
    pd: Bootstrap = COLOCATED  # prefill/decode: host, port, room (None colocated)
    extras: Extras = NO_EXTRAS  # hidden states, input embeddings, ids' logprobs
    # parallel sampling: n choices over one prompt computed once (engine.scheduling.parallel); 1..MAX_N
    n: int = 1
    # a migrated stream: the prompt's last `resumed_tokens` ids are output an earlier decode streamed
    # (sampling treats them as output: seeded positions, penalties and min_new_tokens continue)
    resumed_tokens: int = 0
    # W3C traceparent of the frontend's span for this request; "" = not traced
    traceparent: str = ""
    # vision-language models: the prompt's images in order (their tokens are the model's image token in input_ids)
    images: list[ImageInput] = field(default_factory=list)
    # E/P/D, on a prefill: the encoder whose bootstrap server sends the images' rows (room: pd's); none: the
    # prefill runs the tower itself
    encoder: Bootstrap = COLOCATED
    version: int = 4  # 2: n; 3: the groups; 4: images


@dataclass
class AbortReq:
    """Abort by request id, or by bootstrap room (rid empty), or everything (both empty + all)."""

    rid: str = ""
    room: int | None = None
    abort_all: bool = False
    reason: str = "aborted by client"
    version: int = VERSION


@dataclass
class CloseSessionReq:
    """A session was closed (POST /close_session) or expired: the worker drops its KV pin."""

    session_id: str
    version: int = VERSION


@dataclass
class StatsReq:
    """Ask the worker for a StatsOut (server info, pool usage, counters). `token` pairs the answer."""

    token: int = 0
    version: int = VERSION


@dataclass
class FlushCacheReq:
    """Empty the worker's prefix cache (POST /flush_cache); refused unless the worker is idle.
    `token` pairs the FlushCacheOut."""

    token: int = 0
    version: int = VERSION


@dataclass
class FlushCacheOut:
    token: int
    ok: bool  # False: requests are in flight, nothing was flushed
    message: str
    freed_tokens: int = 0  # KV tokens the flush returned to the pool
    version: int = VERSION


@dataclass
class LoraReq:
    """Load (from `path`) or unload LoRA adapter `name` (service/lora.py); `busy`: adapters requests
    use (never evicted). `token` pairs the LoraOut."""

    token: int
    op: str  # load | unload
    name: str
    path: str = ""
    busy: list[str] = field(default_factory=list)
    version: int = VERSION


@dataclass
class LoraOut:
    token: int
    ok: bool
    code: int  # HTTP status: 200, 400 bad adapter, 404 not loaded, 409 no free slot
    message: str
    evicted: str = ""  # the adapter a load evicted ("" none)
    seconds: float = 0.0  # load time
    version: int = VERSION


@dataclass
class TokenOut:
    """What one request produced since the last TokenBatch."""

    rid: str
    new_token_ids: list[int]
    # one float per new token when return_logprob, else empty
    new_logprobs: list[float] = field(default_factory=list)
    # per new token [ids, logprobs] of its top_logprobs_num alternatives (best first), when asked
    new_top_logprobs: list[list[list]] = field(default_factory=list)
    # prompt logprobs, sent once when computed here: input_start is the first position reported
    # (logprob_start_len), -1 when this worker computed none; the values are those of positions
    # max(input_start, 1).. (position 0 has none), and their [ids, logprobs] alternatives
    input_start: int = -1
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[list[list]] = field(default_factory=list)
    finished: bool = False
    # "stop" | "length" | "abort" | "error" when finished
    finish_reason: str | None = None
    # the stop string or stop token that matched, if any
    matched_stop: str | int | None = None
    # set when finish_reason is "error" or "abort": a human-readable message
    error: str | None = None
    # HTTP-ish status for errors: 400 bad input, 408 timeout, 499 aborted, 500/503 server side
    error_code: int = 0
    # PD only: the role ("prefill" | "decode") whose failure caused this error, when it is the peer's
    fault: str = ""
    # an overload error (503: a full queue, a queue deadline passed): seconds the client should wait
    # before retrying (a Retry-After header; the router tries another worker first); 0: not one
    retry_after: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    index: int = 0  # the choice (n > 1) these tokens belong to
    # engine.extras.features.report: the prompt's hidden states [T][H] (once), one [H] per later decode step;
    # token_ids_logprob values per new output token and per reported prompt position (once)
    hidden_prompt: list[list[float]] = field(default_factory=list)
    hidden_output: list[list[float]] = field(default_factory=list)
    ids_output: list[list[float]] = field(default_factory=list)
    ids_input: list[list[float]] = field(default_factory=list)


@dataclass
class TokenBatch:
    outs: list[TokenOut]
    version: int = 2  # 2: TokenOut.index


@dataclass
class StatsOut:
    """The worker's answer to a StatsReq (token = its token), or its ready signal (token = -1,
    stats None). `info` is the worker's static description (role, model_path, context_length, ...:
    strings and sizes that do not change while it runs); `stats` its typed numbers (service.stats)."""

    token: int
    info: dict[str, Any]
    stats: WorkerStats | None = None
    version: int = 2  # 2: typed stats (1: one untyped info dict)


@dataclass
class EmbedReq:
    """POST /v1/embeddings (service.embeddings): pooled final hidden states of each input's ids, over
    `pooling` ("last" | "mean"), truncated to `dimensions` (0: all) and L2-normalised. `token` pairs
    the EmbedOut."""

    token: int
    inputs: list[list[int]]
    pooling: str = "last"
    dimensions: int = 0
    version: int = VERSION


@dataclass
class EmbedOut:
    token: int
    data: list[list[float]]  # one vector per input, in order
    error: str = ""  # set (and data empty) when the worker could not compute them
    status: int = 0  # HTTP status of the error
    version: int = VERSION


CODEC = Codec("service message", GenerateReq, AbortReq, CloseSessionReq, StatsReq, FlushCacheReq, TokenOut,
              TokenBatch, StatsOut, FlushCacheOut, LoraReq, LoraOut, EmbedReq, EmbedOut, *STATS_PARTS, *GROUPS)
encode = CODEC.encode
decode = CODEC.decode
