"""Req: one generation request as the scheduler sees it (its stop conditions: engine.sampling.stops).

Token bookkeeping: ONE list, `token_ids` = the prompt (its first `num_prompt_tokens` ids) followed
by the generated tokens; `append_token` adds one. `input_ids`/`output_ids` are copies for reports,
never read on the hot path (the batch reads `token_ids` in place). `kv.kv_len` tokens of it have KV
in the cache (in `kv.pages`, or in `kv.host_pages` while retracted). A running decode request has
`len(token_ids) == kv.kv_len + 1`: its last sampled token's KV is computed by the next decode step.

What a request carries beside its tokens is grouped by concern. The groups it was asked with come
from its message as they are (engine.request_groups; service.messages.GenerateReq): `sampling`
(SamplingParams), `options` (ReqOptions: priority, cache salt, session, LoRA), `pd` (Bootstrap: the
PD room), `logprobs.asked` (LogprobParams). Its state: `kv` (KVState: pages and the cache),
`logprobs` (LogprobState: what was computed, what was reported), `choice` (Choice: parallel
sampling), `features` (the model extras asked and computed), plus its finish state, report cursor,
grammar matcher and trace.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from engine.extras.features import Features
from engine.request_groups import COLOCATED, NO_LOGPROBS, NO_OPTIONS, Bootstrap, LogprobParams, ReqOptions
from engine.sampling.logprobs import TopK
from engine.sampling.params import SamplingParams

__all__ = ["Bootstrap", "Choice", "FinishReason", "KVState", "LogprobState", "Req", "SpecState", "Trace"]

if TYPE_CHECKING:
    from engine.extras.multimodal import Multimodal
    from engine.kvcache.radix_cache import Node
    from engine.sampling.grammar import Matcher


class FinishReason(str, Enum):
    STOP = "stop"  # eos, stop token or stop string
    LENGTH = "length"  # max_new_tokens or context length
    ABORT = "abort"
    ERROR = "error"


class Trace(Protocol):
    """A request's spans in a worker (service.tracing.ReqTrace); the engine only holds it, the roles
    call these as the request moves through their queues."""

    def begin(self, phase: str, **attrs: Any) -> None: ...
    def ensure(self, phase: str, **attrs: Any) -> None: ...
    def end(self, phase: str, end_ns: int | None = None, **attrs: Any) -> None: ...
    def annotate(self, phase: str, **attrs: Any) -> None: ...
    def span(self, phase: str, start_ns: int, end_ns: int, **attrs: Any) -> None: ...
    def close(self, error: str | None = None) -> None: ...


@dataclass
class KVState:
    """Where a request's KV lives (engine.kvcache.kv_manager moves it)."""

    pages: list[int] = field(default_factory=list)  # device pages, in token order
    host_pages: list[int] = field(default_factory=list)  # host copy while retracted
    dropped_pages: int = 0  # leading pages freed as out of the sliding window (0 in `pages`)
    kv_len: int = 0  # tokens of Req.token_ids whose KV is computed
    # prefix cache: the first `shared_pages` of `pages` belong to the tree, locked through
    # `prefix_node` until the request is released
    shared_pages: int = 0
    prefix_node: Node | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (reported as usage)
    retractions: int = 0
    # hybrid models (engine/recurrent/state_pool.py): the recurrent-state slot, valid at kv_len tokens
    state_slot: int = -1  # -1: none held
    host_state: Any = None  # torch uint8 [slot bytes]: the state's host copy while retracted
    # prefix cache on a hybrid model: (tokens, slot) state snapshots this request took, deepest last; they go
    # into the tree with its pages at release (engine.kvcache.kv_manager.KVManager.checkpoint)
    snapshots: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class LogprobState:
    """What a request asked for (`asked`, its message's group), what was computed and how much was
    reported."""

    asked: LogprobParams = NO_LOGPROBS
    output: list[float] = field(default_factory=list)
    output_top: list[TopK] = field(default_factory=list)  # when top_k > 0
    # prompt positions max(start_len, 1).. (position 0 has none), computed by extend steps
    input: list[float] = field(default_factory=list)
    input_top: list[TopK] = field(default_factory=list)
    input_done: bool = False  # this worker computed the prompt's logprobs (they are complete)
    input_sent: bool = False  # report cursor of the prompt's logprobs (sent once)

    @property
    def on(self) -> bool:
        """return_logprob: a logprob per output token."""
        return self.asked.on

    @property
    def top_k(self) -> int:
        """Alternatives per token (engine.sampling.logprobs.TopK) when on."""
        return self.asked.top_k

    @property
    def start_len(self) -> int:
        """First prompt position whose logprob is reported; -1: none."""
        return self.asked.start_len

    @property
    def wants_input(self) -> bool:
        return self.on and self.start_len >= 0


@dataclass
class Choice:
    """Parallel sampling (n > 1, engine.scheduling.parallel): choice `index` of the request whose rid is `group`
    ("" for a lone request); the parent (choice 0) holds choices 1..n-1 in `forks` until its prompt
    is computed, then they fork its KV."""

    group: str = ""
    index: int = 0
    forks: list[Req] = field(default_factory=list)


@dataclass
class SpecState:
    """Speculative decoding (engine/extras/speculative): this step's proposed tokens and the request's
    acceptance record (the switch-off rule reads it)."""

    draft: list[int] = field(default_factory=list)  # tokens proposed for this step ([] = a plain decode)
    draft_probs: Any = None  # draft model, sampling: fp32 [len(draft), V], the q each was drawn from
    accepted: int = -1  # drafts the last verify accepted (-1: none verified since the last settle)
    # hybrid models: the state slots taking the recurrent state after each draft position but the last
    # (engine/extras/speculative/states.py), held from before the verify to its settle
    states: list[int] = field(default_factory=list)
    base: int = 0  # kv_len before the verify those slots belong to
    proposed_total: int = 0
    accepted_total: int = 0
    rate: float = 1.0  # running acceptance (an average over recent verifies)
    skip: int = 0  # steps left with speculation switched off for this request
    backoff: int = 0  # length of the next switch-off


@dataclass
class Req:
    rid: str
    token_ids: list[int]  # prompt then output (copied on construction: the request owns it)
    sampling: SamplingParams
    num_prompt_tokens: int = -1  # -1: every id given is the prompt
    stream: bool = False
    logprobs: LogprobState = field(default_factory=LogprobState)
    kv: KVState = field(default_factory=KVState)
    pd: Bootstrap = COLOCATED
    choice: Choice = field(default_factory=Choice)
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    error: str | None = None
    error_code: int = 0
    error_fault: str = ""  # PD role that caused the error when it was the peer, else ""
    retry_after: int = 0  # an overload error (503): seconds after which the client may retry (0: none)
    sent_tokens: int = 0  # report cursor: output tokens already reported to the frontend
    created: float = field(default_factory=time.monotonic)
    # a migrated stream: the last `resumed_tokens` prompt ids were generated by an earlier decode;
    # sampling counts them as output (engine.sampling.sampler.generated)
    resumed_tokens: int = 0
    grammar: Matcher | None = None  # structured output: built on the request's first sample
    trace: Trace | None = None  # the service's spans of this request, or None (untraced)
    options: ReqOptions = NO_OPTIONS  # priority, cache salt, session, LoRA adapter
    spec: SpecState = field(default_factory=SpecState)  # speculative decoding (engine/extras/speculative)
    features: Features = field(default_factory=Features)  # hidden states, input embeds, ids' logprobs
    mm: Multimodal | None = None  # the prompt's images (engine.extras.multimodal); None: text only

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    # the options group's fields by their names (the scheduler, the caches and the roles read them)
    @property
    def priority(self) -> int:
        """--enable-priority-scheduling: the waiting order and preemption (engine.scheduling.priority)."""
        return self.options.priority

    @property
    def extra_key(self) -> str:
        """Cache salt: prefixes are shared only between requests with the same one."""
        return self.options.extra_key

    @extra_key.setter
    def extra_key(self, value: str) -> None:
        self.options = replace(self.options, extra_key=value)

    @property
    def lora(self) -> str:
        """LoRA adapter name ("" = the base model)."""
        return self.options.lora

    @property
    def session_id(self) -> str:
        """A session's request: its KV stays pinned once it ends (engine.scheduling.sessions)."""
        return self.options.session_id

    @session_id.setter
    def session_id(self, value: str) -> None:
        self.options = replace(self.options, session_id=value)

    @property
    def cache_namespace(self) -> str:
        """The prefix-cache partition this request's KV belongs to (engine.kvcache.radix_cache): KV computed
        under another adapter or cache salt is never reused. "" = the shared default."""
        if self.features.namespace:  # input_embeds: placeholder ids, never shared (engine.extras.features)
            return self.features.namespace
        if not self.extra_key and not self.lora:
            return ""
        return f"{self.lora}\x1f{self.extra_key}"

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def input_ids(self) -> list[int]:
        """The prompt (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    def append_token(self, token: int) -> None:
        self.token_ids.append(token)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_retracted(self) -> bool:
        return bool(self.kv.host_pages)

    def matches(self, rid: str = "", room: int | None = None, everything: bool = False) -> bool:
        """The abort predicate: selected by its request id (or its group's: every choice of an n > 1
        request), by its bootstrap room, or by `everything`."""
        return everything or (bool(rid) and rid in (self.rid, self.choice.group)) or \
            (room is not None and self.pd.room == room)

    def finish(self, reason: FinishReason, error: str | None = None, code: int = 0, fault: str = "") -> None:
        """Record the first finish only. `fault`: the PD role ("prefill"/"decode") that caused an
        error, when it is the peer's."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.error = error
            self.error_code = code
            self.error_fault = fault
