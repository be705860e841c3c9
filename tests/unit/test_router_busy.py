"""The router and a worker's overload refusal (issue 53): a 503 whose error names `retry_after` (unary, or a
stream's first event) is no worker failure: nothing is recorded against the worker, the request goes to
another worker of the role that has not refused it, and with none left the client gets the 503 with the
largest Retry-After. A 503 without `retry_after` is still a failure.

Workers are in-process httpx MockTransport handlers (as in test_router_attribution.py): these tests check
the proxy's bookkeeping; tests/integration/test_router_busy.py checks the same over HTTP with stub workers.
"""

from __future__ import annotations

import json

import httpx
import pytest

from router.client import WorkerClient
from router.config import WorkerSpec
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.protocol import parse_request
from router.proxy import Proxy, ProxyError
from router.registry import Registry, Worker

BODY = {"text": "hello there", "sampling_params": {"max_new_tokens": 4}}
OK = {"text": " ok", "meta_info": {"finish_reason": {"type": "length"}}}


def busy(retry_after: int, message: str = "decode queue full") -> dict:
    return {"error": {"message": message, "type": "server_error", "code": 503, "retry_after": retry_after}}


def _proxy(reg: Registry, handler, retries: int = 2) -> Proxy:
    client = WorkerClient(None, 1.0, 5.0, http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    policies = {r: make_policy("round_robin", 256, 4, 1.5) for r in ("prefill", "decode")}
    return Proxy(reg, client, policies, RouterMetrics(), retries, retry_after_s=1)


def _cluster(prefills: int, decodes: int) -> tuple[Registry, list[Worker], list[Worker]]:
    reg = Registry(health_failures=2)
    ps = [reg.add(WorkerSpec(f"http://p{i}:1", "prefill", bootstrap_port=9000 + i)) for i in range(prefills)]
    ds = [reg.add(WorkerSpec(f"http://d{i}:1", "decode")) for i in range(decodes)]
    for w in ps + ds:
        reg.record_success(w)
    return reg, ps, ds


def _answers(refusing: dict[str, dict], seen: list[str]):
    """A handler: the hosts in `refusing` answer their error (as a stream's first event when streamed),
    the others OK; `seen` collects the hosts asked, in order."""

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={})
        seen.append(host)
        stream = json.loads(request.content).get("stream")
        obj = refusing.get(host, OK)
        if stream:  # the HTTP status is 200 once a stream began: the refusal is its first event
            return httpx.Response(200, content=b"data: " + json.dumps(obj).encode() + b"\n\ndata: [DONE]\n\n")
        return httpx.Response(obj["error"]["code"] if "error" in obj else 200, json=obj)

    return handler


def _busy_count(proxy: Proxy, role: str) -> float:
    return proxy.metrics.prom.get_sample_value("pdserve_router_worker_busy_total", {"role": role}) or 0.0


@pytest.mark.parametrize("stream", [False, True])
async def test_busy_decode_is_skipped_and_not_blamed(stream: bool):
    reg, (p0,), (d0, d1) = _cluster(1, 2)
    d0.consecutive_failures = 1  # an earlier failure: a refusal neither adds to it nor resets it
    seen: list[str] = []
    proxy = _proxy(reg, _answers({"d0": busy(5)}, seen))
    for _ in range(3):
        req = parse_request("/generate", {**BODY, "stream": stream})
        if stream:
            events = [e async for e in await proxy.stream(req)]
            assert b" ok" in events[0] and b"error" not in b"".join(events)
        else:
            status, raw = await proxy.unary(req)
            assert status == 200 and b" ok" in raw
    assert seen.count("d0") >= 1 and seen.count("d1") == 3  # d0 was asked and refused each time
    assert d0.consecutive_failures == 1 and d0.eligible and d0.ejections == 0
    assert _busy_count(proxy, "decode") == seen.count("d0") and p0.consecutive_failures == 0
    await proxy.client.close()


async def test_busy_prefill_is_skipped_too():
    reg, (p0, p1), (d0,) = _cluster(2, 1)
    seen: list[str] = []
    proxy = _proxy(reg, _answers({"p0": busy(2, "prefill queue full")}, seen))
    for _ in range(2):
        assert (await proxy.unary(parse_request("/generate", BODY)))[0] == 200
    assert "p0" in seen and p0.consecutive_failures == 0 and p0.eligible and d0.consecutive_failures == 0
    assert _busy_count(proxy, "prefill") == seen.count("p0")
    await proxy.client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_every_decode_busy_gives_503_with_the_largest_retry_after(stream: bool):
    reg, _, (d0, d1) = _cluster(1, 2)
    seen: list[str] = []
    proxy = _proxy(reg, _answers({"d0": busy(3), "d1": busy(7)}, seen), retries=5)
    req = parse_request("/generate", {**BODY, "stream": stream})
    with pytest.raises(ProxyError) as e:
        await (proxy.stream(req) if stream else proxy.unary(req))
    assert e.value.status == 503 and e.value.retry_after_s == 7 and e.value.message == "decode queue full"
    assert sorted(h for h in seen if h.startswith("d")) == ["d0", "d1"]  # each asked once, not 6 attempts
    assert all(d.consecutive_failures == 0 and d.eligible for d in (d0, d1))
    await proxy.client.close()


async def test_attempts_running_out_on_a_refusal_give_its_503():
    reg, _, (d0, d1) = _cluster(1, 2)
    seen: list[str] = []
    proxy = _proxy(reg, _answers({"d0": busy(3), "d1": busy(3)}, seen), retries=0)
    with pytest.raises(ProxyError) as e:
        await proxy.unary(parse_request("/generate", BODY))
    assert e.value.status == 503 and e.value.retry_after_s == 3
    await proxy.client.close()


async def test_a_503_without_retry_after_is_still_a_failure():
    reg, _, (d0, d1) = _cluster(1, 2)
    plain = {"error": {"message": "worker is not running", "type": "server_error", "code": 503}}
    seen: list[str] = []
    proxy = _proxy(reg, _answers({"d0": plain}, seen))
    for _ in range(2):
        assert (await proxy.unary(parse_request("/generate", BODY)))[0] == 200
    assert seen.count("d0") == 2 and not d0.eligible and d0.ejections == 1  # 2 failures: ejected, d1 is left
    assert _busy_count(proxy, "decode") == 0
    await proxy.client.close()
