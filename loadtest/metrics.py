"""Latency and throughput metrics of one bench run, computed from per-request timings.

Definitions (all times in seconds, measured on the client with a monotonic clock):

- TTFT  time to first token: first content chunk arrival - request send.
- ITL   inter-token latency: gap between consecutive content chunks of one request (one sample each).
- TPOT  time per output token of one request: (e2e - ttft) / (output_tokens - 1), requests with >1 token.
- e2e   last chunk arrival (or stream end) - request send.
- goodput  completed requests meeting every given SLO (ttft <= slo_ttft, tpot <= slo_tpot) per second.

Throughputs divide by the run's wall duration: first send to last completion.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestResult:
    """What the client saw for one request. Times are relative to the bench start."""

    index: int
    prompt_len: int  # prompt tokens as counted by the bench's tokenizer
    output_len: int  # max_tokens requested
    start: float  # send time
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float = 0.0  # stream end (or failure) time
    output_tokens: int = 0  # usage.completion_tokens if the server sent it, else content chunks
    server_prompt_tokens: int | None = None  # usage.prompt_tokens if the server sent it
    error: str | None = None
    tag: str = ""  # workload class, e.g. "long" / "short" in the mixed experiment
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens if the server sent it
    text: str = ""  # the streamed reply (kept when the workload needs it: multi-turn chat)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["chunk_times"] = [round(t, 6) for t in self.chunk_times]
        d.update(ttft=self.ttft, tpot=self.tpot, e2e=self.e2e)
        return d


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name, v in (("--slo-ttft", self.ttft_s), ("--slo-tpot", self.tpot_s)):
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {v}")

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return not (self.tpot_s is not None and tpot is not None and tpot > self.tpot_s)


def distribution(values: list[float]) -> dict:
    """mean / min / max / pXX of a sample; all None for an empty sample."""
    keys = ["mean", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if not values:
        return {k: None for k in keys} | {"count": 0}
    a = np.asarray(values, dtype=np.float64)
    out = {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()), "count": int(a.size)}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(a, p))
    return out


def summarize(results: list[RequestResult], slo: SLO = SLO()) -> dict:
    """The summary block of the bench JSON."""
    ok = [r for r in results if r.ok]
    if results:
        t0 = min(r.start for r in results)
        t1 = max(r.end for r in results)
        duration = max(t1 - t0, 1e-9)
    else:
        duration = 0.0
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    good = sum(1 for r in ok if slo.met(r))
    short = sum(1 for r in ok if r.output_tokens != r.output_len)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "short_outputs": short,  # completed with fewer/more tokens than max_tokens asked
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "output_token_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "good_requests": good,
        "goodput": rate(good),
        "goodput_fraction": good / len(results) if results else 0.0,
        "ttft_s": distribution([r.ttft for r in ok]),
        "itl_s": distribution([x for r in ok for x in r.itls]),
        "tpot_s": distribution([t for r in ok if (t := r.tpot) is not None]),
        "e2e_s": distribution([r.e2e for r in ok]),
    }


def summarize_by_tag(results: list[RequestResult], slo: SLO = SLO()) -> dict:
    """`summarize` per workload class (tag), plus "all"."""
    tags = sorted({r.tag for r in results})
    out = {"all": summarize(results, slo)}
    for t in tags:
        if t:
            out[t] = summarize([r for r in results if r.tag == t], slo)
    return out


def fmt_ms(v: float | None) -> str:
    return "-" if v is None or math.isnan(v) else f"{v * 1000:.1f}"
