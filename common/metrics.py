"""Prometheus exposition through prometheus_client, shared by the router and the services.

Each component owns a `CollectorRegistry` (no process-global state: tests build many side by side)
and renders it with `render`. `LabeledCounter` keeps the call sites short
(`requests.inc(endpoint="chat", status="200")`). Values that arrive from elsewhere (the worker's
stats, the router's worker table) are exposed by custom collectors at scrape time.
"""

from __future__ import annotations

from typing import Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

prometheus_client.disable_created_metrics()  # no *_created series: pdserve exports none

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

__all__ = ["CONTENT_TYPE", "ITL_BUCKETS", "LATENCY_BUCKETS", "CollectorRegistry", "Histogram", "LabeledCounter",
           "render", "snapshot"]


def render(registry: CollectorRegistry) -> str:
    """The registry in the Prometheus text format 0.0.4."""
    return generate_latest(registry).decode()


class LabeledCounter:
    """A prometheus_client Counter whose labels are given as keywords at `inc` time."""

    def __init__(self, name: str, help_: str, labels: tuple[str, ...], registry: CollectorRegistry) -> None:
        self.labels = labels
        self.counter = Counter(name, help_, labels, registry=registry)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        if self.labels:
            self.counter.labels(**{k: labels[k] for k in self.labels}).inc(amount)
        else:
            self.counter.inc(amount)

    def get(self, **labels: str) -> float:
        child = self.counter.labels(**labels) if self.labels else self.counter
        return child._value.get()


def snapshot(h: Histogram) -> dict[str, Any]:
    """A histogram as plain data (cumulative counts per finite bound), for a stats message."""
    les: list[float] = []
    counts: list[float] = []
    total = total_sum = 0.0
    for metric in h.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf":
                les.append(float(s.labels["le"]))
                counts.append(s.value)
            elif s.name.endswith("_count"):
                total = s.value
            elif s.name.endswith("_sum"):
                total_sum = s.value
    return {"le": les, "counts": [int(c) for c in counts], "sum": total_sum, "count": int(total)}
