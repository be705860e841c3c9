"""Prometheus metrics of one service frontend (prometheus_client, common.metrics).

The frontend owns `FrontendMetrics`: request counters, token counters, TTFT / inter-token / e2e
latency histograms, in-flight gauges. The worker's numbers arrive as a nested dict (StatsOut.info)
and are exposed by `WorkerStatsCollector` as gauges `pdserve_worker_<name>`:

    {"kv_used_tokens": 12}                 -> pdserve_worker_kv_used_tokens 12
    {"queues": {"waiting": 3}}             -> pdserve_worker_queues{name="waiting"} 3
    {"counters": {"retractions": 1}}       -> pdserve_worker_counters{name="retractions"} 1
    {"histograms": {"x": {"le": [..], "counts": [..], "sum": s, "count": n}}}
                                           -> histogram pdserve_worker_x (counts cumulative per le)

Non-numeric leaves (strings, lists, booleans) are skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import Gauge
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric

from common.metrics import (
    CONTENT_TYPE,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    CollectorRegistry,
    Histogram,
    LabeledCounter,
    is_num,
    metric_name,
    render,
)

__all__ = ["CONTENT_TYPE", "FrontendMetrics", "WorkerStatsCollector", "render_worker_info"]


class WorkerStatsCollector:
    """A custom collector: every number in a worker stats dict, read when scraped."""

    def __init__(self, info: dict[str, Any] | None = None, prefix: str = "pdserve_worker") -> None:
        self.info = info or {}
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        yield from _families(self.info, self.prefix)


def _families(info: dict[str, Any], prefix: str) -> Iterator[Metric]:
    for key, val in sorted(info.items()):
        name = metric_name(prefix, str(key))
        if key == "histograms" and isinstance(val, dict):
            for hname, h in sorted(val.items()):
                if isinstance(h, dict):
                    yield from _histogram(metric_name(prefix, str(hname)), h)
        elif is_num(val):
            yield GaugeMetricFamily(name, f"worker {key}", value=val)
        elif isinstance(val, dict):
            leaves = {str(k): v for k, v in val.items() if is_num(v)}
            if leaves:
                g = GaugeMetricFamily(name, f"worker {key} by name", labels=["name"])
                for k, v in sorted(leaves.items()):
                    g.add_metric([k], v)
                yield g
            nested = {str(k): v for k, v in val.items() if isinstance(v, dict)}
            if nested:
                yield from _families(nested, name)


def _histogram(name: str, h: dict[str, Any]) -> Iterator[Metric]:
    les, counts = h.get("le"), h.get("counts")
    if not isinstance(les, list) or not isinstance(counts, list) or len(les) != len(counts):
        return
    total = h.get("count", counts[-1] if counts else 0)
    buckets = [(repr(float(le)), c) for le, c in zip(les, counts) if is_num(le) and is_num(c)]
    yield HistogramMetricFamily(name, f"worker {name}", buckets=[*buckets, ("+Inf", total)],
                                sum_value=h.get("sum", 0.0))


def render_worker_info(info: dict[str, Any], prefix: str = "pdserve_worker") -> list[str]:
    """The worker stats dict in the text format, as lines (the collector alone in a registry)."""
    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector(info, prefix))
    return render(registry).splitlines()


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = LabeledCounter("pdserve_requests_total", "HTTP generation requests by endpoint and status",
                                       ("endpoint", "status"), r)
        self.prompt_tokens = LabeledCounter("pdserve_prompt_tokens_total", "prompt tokens of finished requests",
                                            (), r)
        self.generation_tokens = LabeledCounter("pdserve_generation_tokens_total", "tokens generated", (), r)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "request arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between streamed tokens",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "request arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("pdserve_running_requests", "requests in flight in this frontend", registry=r)
        self.worker_up = Gauge("pdserve_worker_up", "1 while the worker process is alive and ready", registry=r)
        self.draining = Gauge("pdserve_draining", "1 while the service drains before shutdown", registry=r)
        self.worker = WorkerStatsCollector()
        r.register(self.worker)

    def render(self, running: int, worker_up: bool, draining: bool, worker: dict[str, Any] | None = None) -> str:
        """The text exposition; `worker` is the worker's latest stats (None: not rendered)."""
        self.running.set(running)
        self.worker_up.set(int(worker_up))
        self.draining.set(int(draining))
        self.worker.info = worker or {}
        return render(self.registry)
