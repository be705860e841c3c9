"""Router metrics in the Prometheus text format (no client library: counters, histograms and gauges
read from the registry at scrape time are all we need).

    pdserve_router_requests_total{endpoint,status}    requests finished, by HTTP status (or "stream_error")
    pdserve_router_retries_total                      attempts re-run on another pair
    pdserve_router_ejections_total{role,url}          healthy -> ejected transitions
    pdserve_router_ttft_seconds                       router-side time to first streamed token event
    pdserve_router_itl_seconds                        router-side gap between streamed events
    pdserve_router_e2e_seconds                        router-side request latency
    pdserve_router_worker_outstanding_requests{role,url}, ..._tokens{role,url}, ..._healthy{role,url}
"""

from __future__ import annotations

from collections import defaultdict

from router.registry import Registry
from service.metrics import Histogram

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _labels(pairs: tuple[tuple[str, str], ...]) -> str:
    if not pairs:
        return ""
    esc = lambda v: str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in pairs) + "}"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(v)


class Counter:
    def __init__(self, name: str, help_: str) -> None:
        self.name, self.help = name, help_
        self.values: dict[tuple[tuple[str, str], ...], float] = defaultdict(float)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[tuple(sorted(labels.items()))] += amount

    def get(self, **labels: str) -> float:
        return self.values.get(tuple(sorted(labels.items())), 0.0)

    def total(self) -> float:
        return sum(self.values.values())

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        out += [f"{self.name}{_labels(k)} {_num(v)}" for k, v in sorted(self.values.items())]
        if not self.values:
            out.append(f"{self.name} 0")
        return out


class RouterMetrics:
    def __init__(self) -> None:
        self.requests = Counter("pdserve_router_requests_total", "Requests finished, by endpoint and status")
        self.retries = Counter(
            "pdserve_router_retries_total", "Attempts re-run on another prefill/decode pair"
        )
        self.ejections = Counter(
            "pdserve_router_ejections_total", "Workers ejected after failed probes/requests"
        )
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds", "Router-side time to first token event", LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "pdserve_router_itl_seconds", "Router-side gap between stream events", ITL_BUCKETS
        )
        self.e2e = Histogram("pdserve_router_e2e_seconds", "Router-side request latency", LATENCY_BUCKETS)

    def render(self, registry: Registry) -> str:
        lines: list[str] = []
        for m in (self.requests, self.retries, self.ejections, self.ttft, self.itl, self.e2e):
            lines += m.render()
        gauges = (
            (
                "pdserve_router_worker_outstanding_requests",
                "Requests in flight per worker",
                lambda w: w.outstanding_requests,
            ),
            (
                "pdserve_router_worker_outstanding_tokens",
                "Estimated tokens in flight per worker",
                lambda w: w.outstanding_tokens,
            ),
            (
                "pdserve_router_worker_healthy",
                "1 if the worker takes new requests",
                lambda w: int(w.eligible),
            ),
        )
        for name, help_, get in gauges:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
            lines += [f"{name}{_labels((('role', w.role), ('url', w.url)))} {get(w)}" for w in registry.all()]
        return "\n".join(lines) + "\n"
