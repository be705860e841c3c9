"""Prometheus metrics of one service frontend (prometheus_client, common.metrics).

The frontend owns `FrontendMetrics`: request counters, token counters, TTFT / inter-token / e2e
latency histograms, in-flight gauges. The worker's numbers arrive typed (StatsOut.stats, a
service.stats.WorkerStats) and `WORKER_METRICS` declares each metric once, with its type: a level
is a gauge, a total is a `_total` counter, a latency a histogram. A field the worker's role does
not have (None) is not rendered. Names keep their historical form, e.g.

    WorkerStats.kv.used_tokens            -> gauge   pdserve_worker_kv_used_tokens
    WorkerStats.queues["waiting"]         -> gauge   pdserve_worker_queues{name="waiting"}
    WorkerStats.counters.retractions      -> counter pdserve_worker_retractions_total
    WorkerStats.transfer.seconds          -> histogram pdserve_worker_transfer_seconds

The numeric sizes of the worker's static description (StatsOut.info: `INFO_GAUGES`, e.g.
max_total_tokens) are gauges too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

from prometheus_client import Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from common.checks import is_num
from common.metrics import (
    CONTENT_TYPE,
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    CollectorRegistry,
    Histogram,
    LabeledCounter,
    render,
)
from service.messages import StatsOut
from service.stats import Counters, Histo, WorkerStats

__all__ = ["CONTENT_TYPE", "INFO_GAUGES", "WORKER_METRICS", "FrontendMetrics", "WorkerMetric",
           "WorkerStatsCollector", "render_worker_stats"]

PREFIX = "pdserve_worker_"
# numbers of the worker's static description exported as gauges pdserve_worker_<key>
INFO_GAUGES = ("num_layers", "num_kv_heads", "head_dim", "vocab_size", "context_length", "page_size",
               "max_total_tokens", "host_kv_tokens", "kv_bytes_per_token", "bootstrap_port", "state_slots",
               "state_bytes_per_slot", "state_snapshot_slots", "state_verify_slots")

Value = float | dict[str, float] | Histo | None


@dataclass(frozen=True)
class WorkerMetric:
    """One worker metric: its full name (a counter's ends in `_total`), type, help, and how to read
    it from the stats. `read` gives a number, a {label value: number} map (label `name`), a Histo,
    or None (this role has none: nothing rendered)."""

    name: str
    kind: str  # "gauge" | "counter" | "histogram"
    help: str
    read: Callable[[WorkerStats], Value]

    def families(self, s: WorkerStats) -> Iterator[Metric]:
        v = self.read(s)
        if v is None:
            return
        if isinstance(v, Histo):
            buckets = [(repr(float(le)), c) for le, c in zip(v.le, v.counts)]
            yield HistogramMetricFamily(self.name, self.help, buckets=[*buckets, ("+Inf", v.count)],
                                        sum_value=v.sum)
            return
        family = CounterMetricFamily if self.kind == "counter" else GaugeMetricFamily
        if isinstance(v, dict):
            fam = family(self.name, self.help, labels=["name"])
            for k, x in sorted(v.items()):
                fam.add_metric([k], x)
            yield fam
        else:
            yield family(self.name, self.help, value=v)


def _gauge(name: str, help_: str, read: Callable[[WorkerStats], Value]) -> WorkerMetric:
    return WorkerMetric(PREFIX + name, "gauge", help_, read)


def _counter(name: str, help_: str, read: Callable[[WorkerStats], Value]) -> WorkerMetric:
    assert name.endswith("_total"), name
    return WorkerMetric(PREFIX + name, "counter", help_, read)


def _counter_field(name: str) -> WorkerMetric:
    return _counter(f"{name}_total", f"worker {name.replace('_', ' ')} since start",
                    lambda s: getattr(s.counters, name))


def _hicache_metrics() -> tuple[WorkerMetric, ...]:
    """Per-tier metrics of the prefix cache's host/disk tiers (engine/kvcache/hicache; label name = device,
    host or disk); none rendered while the tiers are off."""
    def tier(stat: str) -> Callable[[WorkerStats], Value]:
        return lambda s: s.prefix.tiers.get(stat) or None

    return (_counter("hicache_hit_tokens_total", "prompt tokens served from each cache tier", tier("hit_tokens")),
            _counter("hicache_loaded_bytes_total", "KV bytes loaded into device pages from each lower tier",
                     tier("loaded_bytes")),
            _counter("hicache_load_seconds_total", "seconds spent loading KV from each lower tier",
                     tier("load_seconds")),
            _counter("hicache_evictions_total", "pages evicted from each cache tier", tier("evictions")),
            _gauge("hicache_bytes_in_use", "KV bytes each cache tier holds", tier("bytes_in_use")))


def _spec_metrics() -> tuple[WorkerMetric, ...]:
    """Speculative decoding (engine/extras/speculative): totals and the two ratios since start; none rendered
    while --speculative is off."""
    def spec(read: Callable[[Any], Value]) -> Callable[[WorkerStats], Value]:
        return lambda s: None if s.spec is None else read(s.spec)

    return (_counter("spec_proposed_tokens_total", "draft tokens proposed to a verify",
                     spec(lambda t: t.proposed_tokens)),
            _counter("spec_accepted_tokens_total", "draft tokens the target accepted",
                     spec(lambda t: t.accepted_tokens)),
            _counter("spec_verify_steps_total", "request steps that verified a draft", spec(lambda t: t.verify_steps)),
            _counter("spec_emitted_tokens_total", "tokens emitted by verify steps (accepted drafts + the target's own)",
                     spec(lambda t: t.emitted_tokens)),
            _counter("spec_switched_off_total", "times a request paused speculating (acceptance below the threshold)",
                     spec(lambda t: t.switched_off)),
            _counter("spec_batch_off_steps_total", "steps where the batch was too large to speculate",
                     spec(lambda t: t.batch_off_steps)),
            _gauge("spec_acceptance_rate", "accepted / proposed draft tokens since start",
                   spec(lambda t: t.acceptance_rate)),
            _gauge("spec_mean_accepted_length", "tokens emitted per verify step since start",
                   spec(lambda t: t.mean_accepted_length)))


def _link(read: Callable[[Any], Value]) -> Callable[[WorkerStats], Value]:
    return lambda s: None if s.link is None else read(s.link)


def _xfer(read: Callable[[Any], Value]) -> Callable[[WorkerStats], Value]:
    return lambda s: None if s.transfer is None else read(s.transfer)


WORKER_METRICS: tuple[WorkerMetric, ...] = (
    _gauge("queues", "requests in each worker queue", lambda s: s.queues),
    _gauge("kv_used_tokens", "KV pool tokens in use", lambda s: s.kv.used_tokens),
    _gauge("kv_total_tokens", "KV pool size in tokens", lambda s: s.kv.total_tokens),
    _gauge("host_kv_used_pages", "host (offload) KV pool pages in use", lambda s: s.kv.host_used_pages),
    _gauge("state_slots_used", "hybrid models: recurrent-state slots requests hold (one per running request; "
           "the pool's size is state_slots in /server_info, prefix-cache snapshots apart: "
           "pdserve_worker_prefix_state_snapshots)", lambda s: s.kv.state_slots_used),
    _gauge("kv_usage", "decode: share of the KV pool in use (0..1), an autoscaling signal", lambda s: s.kv.usage),
    _gauge("queued_prompt_tokens", "prefill: prompt tokens still to prefill, an autoscaling signal",
           lambda s: s.queued_prompt_tokens),
    _gauge("running_requests", "decode: requests in the decode batch, an autoscaling signal",
           lambda s: s.running_requests),
    _gauge("active_rooms", "KV transfer rooms created and not yet released", lambda s: s.active_rooms),
    _gauge("prefix_cached_tokens", "tokens held by the prefix cache", lambda s: s.prefix.cached_tokens),
    _counter("prefix_hit_tokens_total", "prompt tokens served from the prefix cache", lambda s: s.prefix.hit_tokens),
    _counter("prefix_evicted_tokens_total", "tokens evicted from the prefix cache",
             lambda s: s.prefix.evicted_tokens),
    _gauge("prefix_state_snapshots", "hybrid models: recurrent-state snapshots of the prefix cache, in the tree or "
           "held by running requests (one state slot each, out of --state-cache-slots)",
           lambda s: s.prefix.state_snapshots if s.prefix.state_snapshot_slots else None),
    _counter("prefix_state_snapshots_taken_total", "hybrid models: recurrent-state snapshots taken",
             lambda s: s.prefix.state_snapshots_taken if s.prefix.state_snapshot_slots else None),
    _counter("prefix_state_snapshots_evicted_total", "hybrid models: recurrent-state snapshots dropped from the "
             "prefix cache (alone, or with their page)",
             lambda s: s.prefix.state_snapshots_evicted if s.prefix.state_snapshot_slots else None),
    *_hicache_metrics(),
    *_spec_metrics(),
    *(_counter_field(f.name) for f in fields(Counters)),
    _gauge("time", "the worker's clock at its last stats answer (unix seconds)", lambda s: s.time),
    _gauge("transfer", "KV transfer link levels by name", _link(lambda k: k.levels())),
    _counter("transfer_background_passes_total", "progress-thread passes during forwards",
             _link(lambda k: k.background_passes)),
    _counter("transfer_prefix_refusals_total", "prefill: decode prefix offers refused",
             _link(lambda k: k.prefix_refusals)),
    _counter("transfer_control_dropped_total", "control messages dropped, by reason",
             _link(lambda k: k.control_dropped)),
    _counter("transfer_bytes_total", "KV bytes transferred", _xfer(lambda t: t.bytes)),
    _counter("transfer_bytes_reused_total", "decode: KV bytes not transferred, its prefix cache held them",
             _xfer(lambda t: t.reused_bytes)),
    _counter("transfer_rooms_total", "KV transfer rooms ended, by outcome (succeeded, failed)",
             _xfer(lambda t: {"succeeded": t.rooms_succeeded, "failed": t.rooms_failed})),
    WorkerMetric(PREFIX + "transfer_seconds", "histogram", "room ready to transfer done", _xfer(lambda t: t.seconds)),
    WorkerMetric(PREFIX + "transfer_tail_seconds", "histogram", "prefill: last chunk sent to the decode's SUCCESS",
                 _xfer(lambda t: t.tail_seconds)),
)


class WorkerStatsCollector:
    """A custom collector: the worker's latest StatsOut, read when scraped (None: nothing)."""

    def __init__(self, out: StatsOut | None = None) -> None:
        self.out = out

    def collect(self) -> Iterator[Metric]:
        out = self.out
        if out is None:
            return
        for key in INFO_GAUGES:
            v = out.info.get(key)
            if is_num(v):
                yield GaugeMetricFamily(PREFIX + key, f"worker {key.replace('_', ' ')}", value=v)
        if out.stats is not None:
            for metric in WORKER_METRICS:
                yield from metric.families(out.stats)


def render_worker_stats(out: StatsOut) -> list[str]:
    """The worker's metrics in the text format, as lines (the collector alone in a registry)."""
    registry = CollectorRegistry()
    registry.register(WorkerStatsCollector(out))
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

    def render(self, running: int, worker_up: bool, draining: bool, worker: StatsOut | None = None) -> str:
        """The text exposition; `worker` is the worker's latest stats (None: not rendered)."""
        self.running.set(running)
        self.worker_up.set(int(worker_up))
        self.draining.set(int(draining))
        self.worker.out = worker
        return render(self.registry)
