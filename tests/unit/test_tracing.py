"""common.tracing and common.logs without processes: when tracing turns on, W3C context round trips,
the router's hot-path client carries the traceparent, a router with tracing off never loads the SDK,
and JSON log lines carry the fields a request passed."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from common import tracing
from common.logs import JsonFormatter
from router.http1 import Pool

ROOT = Path(__file__).resolve().parents[2]
OTEL_VARS = ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
             "OTEL_EXPORTER_OTLP_ENDPOINT")


def test_tracing_is_off_unless_an_endpoint_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    assert not tracing.configured("")
    assert tracing.configured("http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert tracing.configured("")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.configured("http://collector:4318")
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.configured("")
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"
    with pytest.raises(ValueError):
        tracing.traces_url("c:4318")


def test_traceparent_round_trip_and_off_is_inert() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    assert not tracing.enabled() and tracing.start("x") is None and tracing.traceparent(None) == ""
    tracing.use_provider(TracerProvider())
    try:
        root = tracing.start("root", "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", kind="server")
        tp = tracing.traceparent(root)
        assert tracing.trace_id(tp) == "ab" * 16 and tp.endswith("-01")
        child = tracing.start("child", tp)
        assert child.parent.span_id == root.get_span_context().span_id
        assert child.get_span_context().trace_id == int("ab" * 16, 16)
        child.end()
        root.end()
    finally:
        tracing.shutdown()
    assert not tracing.enabled()


async def test_hot_path_post_carries_the_traceparent_header() -> None:
    import asyncio

    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:  # keep-alive: both requests may come on one connection
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return
            length = next(int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                          if ln.lower().startswith(b"content-length"))
            seen.append(head + await reader.readexactly(length))
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")

    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    pool = Pool(None, 1.0, 1.0)
    tp = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
    try:
        for header in (tp, ""):
            resp = await pool.post(url, "/generate", b'{"a":1}', header)
            assert await resp.read() == b"{}"
    finally:
        pool.close()
        server.close()
    assert f"\r\ntraceparent: {tp}\r\n\r\n".encode() in seen[0] and seen[0].endswith(b'{"a":1}')
    assert b"traceparent" not in seen[1] and seen[1].endswith(b'\r\n\r\n{"a":1}')


def test_router_with_tracing_off_never_loads_the_sdk() -> None:
    # (FastAPI itself imports the opentelemetry API package; the SDK and the exporter are ours to load.)
    code = ("import sys, router.main, router.app, router.asgi, router.proxy, common.tracing;"
            "from router.main import build_parser, _observability;"
            "_observability(build_parser().parse_args([]));"
            "bad = sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter')));"
            "print(bad); sys.exit(1 if bad or common.tracing.enabled() else 0)")
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stdout + r.stderr


def test_json_log_lines_carry_request_fields() -> None:
    rec = logging.LogRecord("pdserve.frontend", logging.INFO, __file__, 1, "finished rid=%s", ("r1",), None)
    rec.trace_id, rec.status, rec.ttft = "ab" * 16, 200, None
    out = json.loads(JsonFormatter("decode").format(rec))
    assert out["msg"] == "finished rid=r1" and out["level"] == "info" and out["process"] == "decode"
    assert out["trace_id"] == "ab" * 16 and out["status"] == 200 and out["ttft"] is None
    assert out["ts"].endswith("+00:00") and "args" not in out


async def test_router_retry_is_a_second_attempt_span_and_each_post_carries_its_attempt() -> None:
    """Proxy over in-process httpx workers: d0 fails the first attempt, the retry goes to d1."""
    import dataclasses

    import httpx
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from router.client import WorkerClient
    from router.config import WorkerSpec
    from router.metrics import RouterMetrics
    from router.policies import make_policy
    from router.protocol import parse_request
    from router.proxy import Proxy
    from router.registry import Registry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    reg = Registry(3)
    for w in (reg.add(WorkerSpec("http://p0:1", "prefill", bootstrap_port=9000)),
              reg.add(WorkerSpec("http://d0:1", "decode")), reg.add(WorkerSpec("http://d1:1", "decode"))):
        reg.record_success(w)
    posts: list[tuple[str, str]] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={})
        posts.append((request.url.host, request.headers.get("traceparent", "")))
        if request.url.host == "d0":
            return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
        return httpx.Response(200, json={"text": " ok", "meta_info": {}})

    client = WorkerClient(None, 1.0, 5.0, http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    policies = {r: make_policy("round_robin", 256, 4, 1.5) for r in ("prefill", "decode")}
    proxy = Proxy(reg, client, policies, RouterMetrics(), 2)
    root = tracing.start("router.request")
    try:
        req = dataclasses.replace(parse_request("/generate", {"text": "hi"}), trace=root)
        status, _ = await proxy.unary(req)
        root.end()
    finally:
        await client.close()
        tracing.shutdown()
    assert status == 200
    spans = exporter.get_finished_spans()
    attempts = sorted((s for s in spans if s.name == "router.attempt"), key=lambda s: s.attributes["attempt"])
    assert [a.attributes["decode"] for a in attempts] == ["http://d0:1", "http://d1:1"]
    assert attempts[0].attributes["blamed"] == "decode" and not attempts[0].status.is_ok
    assert attempts[1].status.is_ok and all(a.parent.span_id == root.get_span_context().span_id for a in attempts)
    assert len([s for s in spans if s.name == "router.pick"]) == 4
    by_attempt = {f"{a.get_span_context().span_id:016x}": a.attributes["attempt"] for a in attempts}
    assert sorted((host, by_attempt[tp.split("-")[2]]) for host, tp in posts) == [
        ("d0", 0), ("d1", 1), ("p0", 0), ("p0", 1)]
