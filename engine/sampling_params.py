"""Sampling parameters of one request, validated on construction (ValueError with a message)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

MAX_NEW_TOKENS_LIMIT = 1 << 20


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

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        def is_num(x: Any) -> bool:
            return isinstance(x, int | float) and not isinstance(x, bool)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

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
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d
