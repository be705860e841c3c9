"""Typed messages between a service's frontend process and its worker process.

Every message is a small dataclass. On the wire (zmq over ipc) it is a msgpack map with a `type`
and a `version` field; `encode`/`decode` are the only codec. An unknown type or a version mismatch
raises `ValueError` on decode, never a half-read message.

Direction frontend -> worker: GenerateReq, AbortReq, StatsReq.
Direction worker -> frontend: TokenBatch, StatsOut.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

VERSION = 1


@dataclass
class GenerateReq:
    """A tokenized request. `sampling` holds SamplingParams fields (engine/request.py)."""

    rid: str
    input_ids: list[int]
    sampling: dict[str, Any]
    stream: bool = False
    return_logprob: bool = False
    # PD fields (None in colocated mode)
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    version: int = VERSION


@dataclass
class AbortReq:
    """Abort by request id, or by bootstrap room (rid empty), or everything (both empty + all)."""

    rid: str = ""
    room: int | None = None
    abort_all: bool = False
    reason: str = "aborted by client"
    version: int = VERSION


@dataclass
class StatsReq:
    """Ask the worker for a StatsOut (server info, pool usage, counters). `token` pairs the answer."""

    token: int = 0
    version: int = VERSION


@dataclass
class TokenOut:
    """What one request produced since the last TokenBatch."""

    rid: str
    new_token_ids: list[int]
    # one float per new token when return_logprob, else empty
    new_logprobs: list[float] = field(default_factory=list)
    # prompt-token logprobs (first element None-free; len == prompt_len - 1), sent once, when asked
    input_logprobs: list[float] = field(default_factory=list)
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
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class TokenBatch:
    outs: list[TokenOut]
    version: int = VERSION


@dataclass
class StatsOut:
    token: int
    info: dict[str, Any]
    version: int = VERSION


_TYPES: dict[str, type] = {
    c.__name__: c for c in (GenerateReq, AbortReq, StatsReq, TokenOut, TokenBatch, StatsOut)
}


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        d = {f.name: _to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        d["type"] = type(obj).__name__
        return d
    if isinstance(obj, list | tuple):
        return [_to_wire(x) for x in obj]
    return obj


def _from_wire(d: Any) -> Any:
    if isinstance(d, dict) and "type" in d:
        name = d.pop("type")
        cls = _TYPES.get(name)
        if cls is None:
            raise ValueError(f"unknown message type {name!r}")
        if "version" in d and d["version"] != VERSION:
            raise ValueError(f"{name}: version {d['version']} != {VERSION}")
        if cls is TokenBatch:
            d["outs"] = [_from_wire(o) for o in d["outs"]]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})
    return d


def encode(msg: Any) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def decode(data: bytes) -> Any:
    obj = _from_wire(msgpack.unpackb(data, raw=False, strict_map_key=False))
    if not dataclasses.is_dataclass(obj):
        raise ValueError("message without a type")
    return obj
