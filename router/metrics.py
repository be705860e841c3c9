"""Router metrics in the Prometheus text format, through prometheus_client (common.metrics); the
per-worker gauges are read from the registry at scrape time by a custom collector.

    pdserve_router_requests_total{endpoint,status}    requests finished, by HTTP status (or "stream_error")
    pdserve_router_retries_total                      attempts re-run on another pair
    pdserve_router_prefill_here_total                 decodes asked to prefill (their prefill was busy)
    pdserve_router_worker_busy_total{role}            overload refusals (a 503 with retry_after), tried elsewhere
    pdserve_router_image_requests_total{path}         requests with images by the path of their last attempt: epd
                                                      (through an encoder) or pd (no encoder eligible: the prefill
                                                      runs the vision tower); a migrated stream's new leg counts again
    pdserve_router_ejections_total{role,url}          healthy -> ejected transitions
    pdserve_router_ttft_seconds                       router-side time to first streamed token event
    pdserve_router_itl_seconds                        router-side gap between streamed events
    pdserve_router_e2e_seconds                        router-side request latency
    pdserve_router_worker_outstanding_requests{role,url}, ..._tokens{role,url}, ..._healthy{role,url}
    pdserve_router_kv_index_predicted_cached_tokens_total   prompt tokens the KV index predicted cached on the
                                                      prefills it picked (requests with token ids, workers with events)
    pdserve_router_kv_index_reported_cached_tokens_total    the cached tokens those prefills reported for them
    pdserve_router_kv_index_blocks{url,medium}        blocks the KV index holds per worker and medium
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.metrics import CollectorRegistry, Histogram, LabeledCounter, render
from router.kv_index import KVIndex
from router.registry import Registry

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
WORKER_GAUGES = (
    ("pdserve_router_worker_outstanding_requests", "Requests in flight per worker", lambda w: w.outstanding_requests),
    ("pdserve_router_worker_outstanding_tokens", "Estimated tokens in flight per worker",
     lambda w: w.outstanding_tokens),
    ("pdserve_router_worker_healthy", "1 if the worker takes new requests", lambda w: int(w.eligible)),
)


class WorkerTableCollector:
    """A custom collector: the registry's per-worker load and health, read when scraped."""

    def __init__(self) -> None:
        self.registry: Registry | None = None
        self.kv_index: KVIndex | None = None

    def collect(self) -> Iterator[Metric]:
        workers = self.registry.all() if self.registry is not None else []
        for name, help_, get in WORKER_GAUGES:
            g = GaugeMetricFamily(name, help_, labels=["role", "url"])
            for w in workers:
                g.add_metric([w.role, w.url], get(w))
            yield g
        kv = self.kv_index
        if kv is None:
            return
        for what in ("predicted", "reported"):
            c = CounterMetricFamily(f"pdserve_router_kv_index_{what}_cached_tokens",
                                    f"Prompt tokens cached on the picked prefill, {what} (KV index vs the worker)")
            c.add_metric([], getattr(kv, f"{what}_total"))
            yield c
        g = GaugeMetricFamily("pdserve_router_kv_index_blocks", "Blocks the KV index holds per worker and medium",
                              labels=["url", "medium"])
        for url, w in kv.workers.items():
            for medium, blocks in w.media.items():
                g.add_metric([url, medium], len(blocks))
        yield g


class RouterMetrics:
    def __init__(self) -> None:
        self.prom = r = CollectorRegistry()
        self.requests = LabeledCounter("pdserve_router_requests_total", "Requests finished, by endpoint and status",
                                       ("endpoint", "status"), r)
        self.retries = LabeledCounter("pdserve_router_retries_total",
                                      "Attempts re-run on another prefill/decode pair", (), r)
        self.prefill_here = LabeledCounter(
            "pdserve_router_prefill_here_total",
            "Requests whose decode was asked to prefill them (the picked prefill had --local-prefill-queue-tokens "
            "outstanding)", (), r)
        self.worker_busy = LabeledCounter(
            "pdserve_router_worker_busy_total",
            "Attempts a worker refused as overloaded (a 503 with retry_after): not failures, tried on another "
            "worker of the role", ("role",), r)
        self.image_requests = LabeledCounter(
            "pdserve_router_image_requests_total",
            "Requests with images by path: epd (encoder -> prefill -> decode) or pd (no encoder eligible)", ("path",),
            r)
        self.migrations = LabeledCounter("pdserve_router_migrations_total",
                                         "Streams moved to another pair after their decode failed mid-stream", (), r)
        self.ejections = LabeledCounter("pdserve_router_ejections_total",
                                        "Workers ejected after failed probes/requests", ("role", "url"), r)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "Router-side time to first token event",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pdserve_router_itl_seconds", "Router-side gap between stream events",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pdserve_router_e2e_seconds", "Router-side request latency",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.workers = WorkerTableCollector()
        r.register(self.workers)

    @property
    def kv_index(self) -> KVIndex | None:
        return self.workers.kv_index

    @kv_index.setter
    def kv_index(self, kv: KVIndex | None) -> None:
        self.workers.kv_index = kv

    def render(self, registry: Registry) -> str:
        self.workers.registry = registry
        return render(self.prom)
