"""Sampling parameters of one request, validated on construction (ValueError with a message).

A service never builds them from a raw body: the body is parsed once by the request models
(common/api_requests.py), and the frontend hands the validated model's values to `from_dict`, which
turns JSON shapes into this value's (lists -> tuples, logit_bias -> sorted pairs, a schema object ->
text). The checks here are the value's invariants, for the offline API (engine.engine.LLM) and the
msgpack reader of a GenerateReq (common/codec.py: a bad frame raises, never a bad request)."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from common.checks import is_int, is_num, need

MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_GRAMMAR_CHARS = 1 << 16


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency_penalty * (times generated)
    presence_penalty: float = 0.0  # OpenAI: logit -= presence_penalty once a token was generated
    repetition_penalty: float = 1.0  # CTRL/transformers, over prompt and output tokens; 1 = off
    min_new_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens were generated
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    # structured output (SGLang's names; at most one): the output must match it (engine.sampling.grammar)
    json_schema: str | None = None  # a JSON schema, as JSON text
    regex: str | None = None
    ebnf: str | None = None  # an EBNF grammar (xgrammar's GBNF dialect, root rule `root`)

    def __post_init__(self) -> None:
        need(is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
             f"temperature must be a number in [0, 100], got {self.temperature!r}")
        need(is_num(self.top_p) and 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1),
             f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        need(is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(is_int(self.max_new_tokens) and 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT,
             f"max_new_tokens must be an integer in [1, {MAX_NEW_TOKENS_LIMIT}], got {self.max_new_tokens!r}")
        need(isinstance(self.stop, tuple) and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of non-empty strings")
        need(len(self.stop) <= 16, "at most 16 stop strings")
        need(isinstance(self.stop_token_ids, tuple) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be a list of non-negative integers")
        need(isinstance(self.ignore_eos, bool), "ignore_eos must be a boolean")
        need(self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**63),
             f"seed must be a non-negative integer, got {self.seed!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            need(is_num(v) and -2.0 <= v <= 2.0, f"{name} must be a number in [-2, 2], got {v!r}")
        need(is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be a number in (0, 2], got {self.repetition_penalty!r}")
        need(is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
             f"min_new_tokens must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
             f"got {self.min_new_tokens!r}")
        need(isinstance(self.logit_bias, tuple) and len(self.logit_bias) <= 1024
             and all(isinstance(p, tuple) and len(p) == 2 and is_int(p[0]) and p[0] >= 0 and is_num(p[1])
                     and -100.0 <= p[1] <= 100.0 for p in self.logit_bias),
             "logit_bias must map at most 1024 token ids (>= 0) to biases in [-100, 100]")
        grammars = [k for k in ("json_schema", "regex", "ebnf") if getattr(self, k) is not None]
        need(len(grammars) <= 1, f"give at most one of json_schema, regex, ebnf (got {', '.join(grammars)})")
        for k in grammars:
            v = getattr(self, k)
            need(isinstance(v, str) and 0 < len(v) <= MAX_GRAMMAR_CHARS,
                 f"{k} must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")

    def within(self, room: int) -> SamplingParams:
        """These params with max_new_tokens and min_new_tokens capped at `room` (>= 1: the context left
        after the prompt). Capping keeps every check true, so the copy is not validated again."""
        if self.max_new_tokens <= room:
            return self
        capped = copy.copy(self)
        object.__setattr__(capped, "max_new_tokens", room)
        object.__setattr__(capped, "min_new_tokens", min(self.min_new_tokens, room))
        return capped

    @property
    def has_processors(self) -> bool:
        """Whether any logit processor applies (penalties, min_new_tokens, logit_bias)."""
        return bool(self.frequency_penalty or self.presence_penalty or self.repetition_penalty != 1.0
                    or self.min_new_tokens or self.logit_bias)

    @property
    def has_grammar(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Build from a JSON-ish dict; unknown keys and bad types raise ValueError."""
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        stop = d.get("stop")
        if stop is None:
            d["stop"] = ()
        elif isinstance(stop, str):
            d["stop"] = (stop,)
        elif isinstance(stop, list):
            d["stop"] = tuple(stop)
        else:
            raise ValueError("stop must be a string or a list of strings")
        ids = d.get("stop_token_ids")
        if ids is None:
            d["stop_token_ids"] = ()
        elif isinstance(ids, list):
            d["stop_token_ids"] = tuple(ids)
        else:
            raise ValueError("stop_token_ids must be a list of integers")
        d["logit_bias"] = parse_logit_bias(d.get("logit_bias"))
        schema = d.get("json_schema")
        if isinstance(schema, dict):  # SGLang takes the schema as a string; an object is the same schema
            d["json_schema"] = json.dumps(schema)
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        return d


def parse_logit_bias(raw: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map (keys are strings in JSON), or [[id, bias], ...] (to_dict's
    form), as sorted (id, bias) pairs; ValueError naming the bad entry."""
    if raw is None:
        return ()
    items = raw.items() if isinstance(raw, dict) else raw
    if not isinstance(raw, dict | list | tuple):
        raise ValueError("logit_bias must be an object mapping token ids to biases")
    out = {}
    for item in items:
        if not (isinstance(item, list | tuple) and len(item) == 2):
            raise ValueError(f"logit_bias entry {item!r} must be [token_id, bias]")
        key, bias = item
        try:
            tok = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            tok = None
        if tok is None or isinstance(key, float):
            raise ValueError(f"logit_bias key {key!r} is not a token id")
        if isinstance(bias, bool) or not isinstance(bias, int | float):
            raise ValueError(f"logit_bias value for token {key!r} must be a number, got {bias!r}")
        out[tok] = float(bias)
    return tuple(sorted(out.items()))
