"""Req: one generation request as the scheduler sees it, and its stop conditions.

`TailDecoder` is the one text decoder stop strings are checked with (every scheduler builds its
StopChecker with one).

Token bookkeeping: `fill_ids = input_ids + output_ids`; `kv_len` tokens of it have KV in the cache
(in `pages`, or in `host_pages` while retracted). A running decode request has
`len(fill_ids) == kv_len + 1`: its last sampled token's KV is computed by the next decode step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from engine.logprobs import TopK
from engine.sampling_params import SamplingParams


class FinishReason(str, Enum):
    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_new_tokens or context length
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Req:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0  # alternatives per token (engine.logprobs.TopK) when return_logprob
    logprob_start_len: int = -1  # first prompt position whose logprob is reported; -1: none
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # device pages, in token order
    host_pages: list[int] = field(default_factory=list)  # host copy while retracted
    dropped_pages: int = 0  # leading pages freed as out of the sliding window (0 in `pages`)
    kv_len: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_code: int = 0
    error_fault: str = ""  # PD role that caused the error when it was the peer, else ""
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[TopK] = field(default_factory=list)  # when top_logprobs_num > 0
    # prompt positions max(logprob_start_len, 1).. (position 0 has none), computed by extend steps
    input_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[TopK] = field(default_factory=list)
    cached_tokens: int = 0
    sent_tokens: int = 0  # output tokens already reported to the frontend
    input_logprobs_done: bool = False  # this worker computed the prompt's logprobs (they are complete)
    input_logprobs_sent: bool = False
    retractions: int = 0
    # PD
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    created: float = field(default_factory=time.monotonic)
    # the service's per-request trace (service.tracing.ReqTrace) or None; opaque to the engine
    trace: Any = None

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def wants_input_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_retracted(self) -> bool:
        return bool(self.host_pages)

    def matches(self, rid: str = "", room: int | None = None, everything: bool = False) -> bool:
        """The abort predicate: selected by its request id, by its bootstrap room, or by `everything`."""
        return everything or (bool(rid) and self.rid == rid) or (room is not None and self.bootstrap_room == room)

    def finish(self, reason: FinishReason, error: str | None = None, code: int = 0, fault: str = "") -> None:
        """`fault`: the PD role ("prefill"/"decode") that caused an error, when it is the peer's."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
            self.error_code = code
            self.error_fault = fault


class TailDecoder:
    """Output ids -> text for stop strings, with the model's own tokenizer (loaded on first use, so a
    worker whose requests carry no stop strings never loads it)."""

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = str(model_path)
        self._tok: Any = None

    def __call__(self, ids: list[int]) -> str:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_path)
        return self._tok.decode(ids, skip_special_tokens=False)


class StopChecker:
    """Decides whether the last appended token ends a request."""

    def __init__(self, eos_ids: tuple[int, ...], context_length: int, decode_tail=None) -> None:  # noqa: ANN001
        self.eos_ids = set(eos_ids)
        self.context_length = context_length
        self.decode_tail = decode_tail  # callable(list[int]) -> str, for stop strings

    def check(self, req: Req) -> None:
        sp = req.sampling
        tok = req.output_ids[-1]
        if tok in sp.stop_token_ids:
            req.matched_stop = tok
            req.finish(FinishReason.STOP)
            return
        if not sp.ignore_eos and tok in self.eos_ids:
            req.matched_stop = tok
            req.finish(FinishReason.STOP)
            return
        if sp.stop and self.decode_tail is not None:
            longest = max(len(s) for s in sp.stop)
            tail = self.decode_tail(req.output_ids[-(longest + 8):])
            for s in sp.stop:
                if s in tail:
                    req.matched_stop = s
                    req.finish(FinishReason.STOP)
                    return
        if len(req.output_ids) >= sp.max_new_tokens:
            req.finish(FinishReason.LENGTH)
        elif len(req.input_ids) + len(req.output_ids) >= self.context_length:
            req.finish(FinishReason.LENGTH)
