"""Issue 18 across real processes: a router, a prefill and a decode service (embedded model, UCX),
all exporting traces over OTLP/HTTP to a collector in this test.

1. One PD request (with the client's traceparent) yields one connected trace across the router,
   both frontends and both workers, with the router's pick/attempt/stream spans, the prefill's queue,
   chunk and transfer spans and the decode's admission, transfer and running spans.
2. `--log-format json`: the decode's finished-request line is JSON carrying that trace id.
3. Every PromQL expression of deploy/grafana/pdserve-dashboard.json names metrics these live
   services export (scraped after the request, so worker histograms and counters exist).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path

import httpx
import pytest
from otlp_collector import Collector, render_tree
from pd_harness import read_sse, start_service
from router_harness import ROOT, start_router, wait_for

pytestmark = pytest.mark.slow

DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"
PROMPT = ("Name the three primary colors of light and explain, in one short sentence each, how a screen mixes "
          "them into white light.")
WANT_SPANS = {
    "pdserve-router": {"router.request", "router.attempt", "router.pick", "router.stream"},
    "pdserve-prefill": {"prefill.request", "prefill.bootstrap_queue", "prefill.waiting_queue", "prefill.chunk",
                        "prefill.kv_transfer"},
    "pdserve-decode": {"decode.request", "decode.admission", "decode.kv_transfer", "decode.running"},
}


@pytest.fixture(scope="module")
def stack():
    collector = Collector()
    saved = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # export within 0.1 s (children copy the environment)
    procs = []
    try:
        otlp = ["--otlp-endpoint", collector.url]
        pre, boot = start_service("prefill", *otlp, "--chunked-prefill-size", "16")
        procs.append(pre)
        dec, _ = start_service("decode", *otlp, "--log-format", "json", "--log-level", "info")
        procs.append(dec)
        router = start_router(["--prefill", f"{pre.url},bootstrap_port={boot}", "--decode", dec.url, *otlp])
        procs.append(router)
        for p in procs:
            p.wait_healthy(600)
        wait_for(lambda: httpx.get(router.url + "/health", timeout=2).status_code == 200, 60, "router sees workers")
        yield {"collector": collector, "router": router, "prefill": pre, "decode": dec}
    finally:
        for p in procs:
            p.stop()
        collector.close()
        if saved is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = saved


@pytest.fixture(scope="module")
def traced(stack):
    """One streamed chat completion through the router, sent with the client's own traceparent."""
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "x", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "stream": True,
            "temperature": 0}
    with httpx.Client(timeout=300) as c, c.stream(
            "POST", stack["router"].url + "/v1/chat/completions", json=body,
            headers={"traceparent": f"00-{trace_id}-{client_span}-01"}) as r:
        assert r.status_code == 200, r.read()
        events = read_sse(r)
    assert events and not any("error" in e for e in events), events
    col = stack["collector"]

    def complete() -> bool:
        have = {(s.service, s.name) for s in col.trace(trace_id)}
        return all((svc, n) in have for svc, names in WANT_SPANS.items() for n in names)

    try:
        wait_for(complete, 60, "every span of the request at the collector", interval=0.1)
    except TimeoutError:
        raise AssertionError(render_tree(col.trace(trace_id))) from None
    return trace_id, client_span


def test_one_pd_request_is_one_connected_trace(stack, traced) -> None:
    trace_id, client_span = traced
    spans = stack["collector"].trace(trace_id)
    print(f"\ntrace {trace_id} ({len(spans)} spans):\n{render_tree(spans)}")
    ids = {s.span_id for s in spans}
    assert len(ids) == len(spans)
    roots = [s for s in spans if s.parent_id not in ids]
    assert [(s.name, s.parent_id) for s in roots] == [("router.request", client_span)], "one tree under the client"
    assert not [s for s in spans if s.error], "no span failed"
    by_name = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    parent = {s.span_id: s for s in spans}
    attempt = by_name["router.attempt"][0]
    assert attempt.attributes["attempt"] == 0 and attempt.attributes["room"]
    assert {p.attributes["role"] for p in by_name["router.pick"]} == {"prefill", "decode"}
    for role in ("prefill", "decode"):  # each frontend continues the router's attempt span
        (req,) = by_name[f"{role}.request"]
        assert parent[req.parent_id].name == "router.attempt"
    chunks = by_name["prefill.chunk"]
    assert len(chunks) >= 2 and sum(c.attributes["tokens"] for c in chunks) == by_name[
        "prefill.bootstrap_queue"][0].attributes["prompt_tokens"]
    for side in ("prefill", "decode"):
        (x,) = by_name[f"{side}.kv_transfer"]
        assert x.attributes["bytes"] > 0 and x.attributes["room"] == attempt.attributes["room"]
        assert parent[x.parent_id].name == f"{side}.request"
    assert by_name["decode.running"][0].attributes["completion_tokens"] == 6
    assert by_name["router.stream"][0].attributes["outcome"] == "200"


def test_json_request_log_carries_the_trace_id(stack, traced) -> None:
    trace_id, _ = traced

    def finished_line() -> dict | None:
        for line in Path(stack["decode"].log_path).read_text().splitlines():
            if line.startswith("{") and '"finished rid=' in line:
                rec = json.loads(line)
                if rec.get("trace_id") == trace_id:
                    return rec
        return None

    rec = wait_for(finished_line, 30, "the decode's JSON finished line")
    assert rec["status"] == 200 and rec["completion_tokens"] == 6 and rec["process"] == "decode"


def _exported_names(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            names.update({"counter": [name + "_total"],
                          "histogram": [name + s for s in ("_bucket", "_sum", "_count")]}.get(kind, []))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_dashboard_queries_name_exported_metrics(stack, traced) -> None:
    exported: set[str] = set()
    for p in ("router", "prefill", "decode"):
        r = httpx.get(stack[p].url + "/metrics", timeout=10)
        r.raise_for_status()
        exported |= _exported_names(r.text)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    missing = {}
    for e in exprs:
        used = set(re.findall(r"\bpdserve_[a-z0-9_]+", e))
        assert used, f"no pdserve metric in {e!r}"
        if used - exported:
            missing[e] = sorted(used - exported)
    assert not missing, missing
    for signal in ("pdserve_worker_queued_prompt_tokens", "pdserve_worker_kv_usage", "pdserve_worker_running_requests"):
        assert signal in exported, f"autoscaling signal {signal} not exported"
