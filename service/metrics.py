"""Prometheus text exposition (format 0.0.4) without a client library.

The frontend owns `FrontendMetrics`: request counters, token counters, TTFT / inter-token / e2e
latency histograms, in-flight gauge. The worker's numbers arrive as a nested dict (StatsOut.info)
and are rendered generically by `render_worker_info` as gauges `pdserve_worker_<name>`:

    {"kv_used_tokens": 12}                 -> pdserve_worker_kv_used_tokens 12
    {"queues": {"waiting": 3}}             -> pdserve_worker_queues{name="waiting"} 3
    {"counters": {"retractions": 1}}       -> pdserve_worker_counters{name="retractions"} 1
    {"histograms": {"x": {"le": [..], "counts": [..], "sum": s, "count": n}}}
                                           -> histogram pdserve_worker_x (counts cumulative per le)

Non-numeric leaves (strings, lists) are skipped.
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _fmt(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    return repr(float(v))


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_esc(str(v))}"' for k, v in sorted(labels.items())) + "}"


def metric_name(*parts: str) -> str:
    name = re.sub(r"[^a-zA-Z0-9_:]", "_", "_".join(p for p in parts if p))
    return name if re.match(r"[a-zA-Z_:]", name) else "_" + name


class Histogram:
    """Fixed buckets, cumulative on render. Thread-safe enough for one event loop plus readers."""

    def __init__(self, name: str, help_: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_, tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for le, c in zip((*self.buckets, math.inf), self.counts):
            acc += c
            out.append(f'{self.name}_bucket{{le="{_fmt(le)}"}} {acc}')
        out += [f"{self.name}_sum {_fmt(self.sum)}", f"{self.name}_count {self.count}"]
        return out


class Counter:
    """A counter family with labels."""

    def __init__(self, name: str, help_: str) -> None:
        self.name, self.help = name, help_
        self.values: dict[tuple[tuple[str, str], ...], float] = {}
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        out += [f"{self.name}{_labels(dict(k))} {_fmt(v)}" for k, v in sorted(self.values.items())]
        return out


def gauge(name: str, help_: str, value: float, labels: dict[str, str] | None = None) -> list[str]:
    return [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name}{_labels(labels or {})} {_fmt(value)}"]


class FrontendMetrics:
    def __init__(self) -> None:
        self.requests = Counter("pdserve_requests_total", "HTTP generation requests by endpoint and status")
        self.prompt_tokens = Counter("pdserve_prompt_tokens_total", "prompt tokens of finished requests")
        self.generation_tokens = Counter("pdserve_generation_tokens_total", "tokens generated")
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "request arrival to first token",
                              LATENCY_BUCKETS)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between streamed tokens",
                             ITL_BUCKETS)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "request arrival to finish",
                             LATENCY_BUCKETS)

    def render(self, running: int, worker_up: bool, draining: bool) -> list[str]:
        out: list[str] = []
        for m in (self.requests, self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            out += m.render()
        out += gauge("pdserve_running_requests", "requests in flight in this frontend", running)
        out += gauge("pdserve_worker_up", "1 while the worker process is alive and ready", int(worker_up))
        out += gauge("pdserve_draining", "1 while the service drains before shutdown", int(draining))
        return out


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _worker_histogram(name: str, h: dict[str, Any]) -> list[str]:
    les, counts = h.get("le"), h.get("counts")
    if not isinstance(les, list) or not isinstance(counts, list) or len(les) != len(counts):
        return []
    out = [f"# TYPE {name} histogram"]
    for le, c in zip(les, counts):
        if _is_num(le) and _is_num(c):
            out.append(f'{name}_bucket{{le="{_fmt(le)}"}} {_fmt(c)}')
    total = h.get("count", counts[-1] if counts else 0)
    out.append(f'{name}_bucket{{le="+Inf"}} {_fmt(total)}')
    out += [f"{name}_sum {_fmt(h.get('sum', 0.0))}", f"{name}_count {_fmt(total)}"]
    return out


def render_worker_info(info: dict[str, Any], prefix: str = "pdserve_worker") -> list[str]:
    """Every number in the worker's stats dict as a gauge (see the module docstring)."""
    out: list[str] = []
    for key, val in sorted(info.items()):
        name = metric_name(prefix, str(key))
        if key == "histograms" and isinstance(val, dict):
            for hname, h in sorted(val.items()):
                if isinstance(h, dict):
                    out += _worker_histogram(metric_name(prefix, str(hname)), h)
        elif _is_num(val):
            out += [f"# TYPE {name} gauge", f"{name} {_fmt(val)}"]
        elif isinstance(val, dict):
            leaves = {str(k): v for k, v in val.items() if _is_num(v)}
            if leaves:
                out.append(f"# TYPE {name} gauge")
                out += [f'{name}{{name="{_esc(k)}"}} {_fmt(v)}' for k, v in sorted(leaves.items())]
            nested = {str(k): v for k, v in val.items() if isinstance(v, dict)}
            if nested:
                out += render_worker_info(nested, name)
    return out
