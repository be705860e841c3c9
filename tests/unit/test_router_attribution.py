"""Router failure attribution and the last-worker rules (issue: `pdserve up` under a load tool).

Workers are in-process httpx MockTransport handlers: these tests check the proxy's bookkeeping
(which worker a failure counts against, who is ejected, how long a request waits), not HTTP.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from router.client import WorkerClient
from router.config import WorkerSpec
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.protocol import parse_request
from router.proxy import Proxy, ProxyError
from router.registry import Registry

BODY = {"text": "hello there", "sampling_params": {"max_new_tokens": 4}}
OK = {"text": " ok", "meta_info": {"finish_reason": {"type": "length"}}}
PREFILL_LOST = {"error": {"message": "KV transfer failed: room 1: prefill 127.0.0.1:9 missed 3 heartbeats",
                          "type": "server_error", "code": 503, "fault": "prefill"}}


def _proxy(reg: Registry, handler, *, worker_wait_s: float = 0.0, retries: int = 2) -> Proxy:
    client = WorkerClient(None, 1.0, 5.0, http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    policies = {r: make_policy("round_robin", 256, 4, 1.5) for r in ("prefill", "decode")}
    return Proxy(reg, client, policies, RouterMetrics(), retries, worker_wait_s=worker_wait_s, retry_after_s=2)


def _cluster(prefills: int, decodes: int, health_failures: int = 3) -> tuple[Registry, list, list]:
    reg = Registry(health_failures)
    ps = [reg.add(WorkerSpec(f"http://p{i}:1", "prefill", bootstrap_port=9000 + i)) for i in range(prefills)]
    ds = [reg.add(WorkerSpec(f"http://d{i}:1", "decode")) for i in range(decodes)]
    for w in ps + ds:
        reg.record_success(w)
    return reg, ps, ds


async def test_decode_blaming_its_prefill_counts_against_the_prefill_and_retries_another():
    reg, (p0, p1), (d0,) = _cluster(2, 1)
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/abort_request":
            return httpx.Response(200, json={})
        seen.append(host)
        if host == "d0" and seen.count("p0") and "p1" not in seen:
            return httpx.Response(503, json=PREFILL_LOST)  # the attempt paired with p0
        return httpx.Response(200, json=OK)

    proxy = _proxy(reg, handler)
    status, raw = await proxy.unary(parse_request("/generate", BODY))
    assert status == 200 and b"ok" in raw
    assert "p1" in seen  # the retry avoided the blamed prefill
    assert p0.consecutive_failures == 1 and d0.consecutive_failures == 0
    await proxy.client.close()


async def test_error_without_fault_counts_against_the_side_that_answered():
    reg, (p0,), (d0, d1) = _cluster(1, 2)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d0" and request.url.path == "/generate":
            return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
        return httpx.Response(200, json=OK)

    proxy = _proxy(reg, handler)
    picks = [(await proxy.unary(parse_request("/generate", BODY)))[0] for _ in range(2)]
    assert picks == [200, 200]
    assert d0.consecutive_failures >= 1 and p0.consecutive_failures == 0 and d1.consecutive_failures == 0
    await proxy.client.close()


async def test_request_failures_never_eject_the_last_eligible_worker_of_a_role():
    reg, _, (d0,) = _cluster(1, 1, health_failures=2)

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d0" and request.url.path == "/generate":
            return httpx.Response(503, json={"error": {"message": "overloaded", "code": 503}})
        return httpx.Response(200, json=OK)

    proxy = _proxy(reg, handler, retries=3)
    with pytest.raises(ProxyError) as e:
        await proxy.unary(parse_request("/generate", BODY))
    assert e.value.status == 502 and "overloaded" in e.value.message
    assert d0.consecutive_failures == 4 and d0.eligible and d0.ejections == 0
    reg.record_failure(d0, "/health answered 503", probe=True)  # probes still decide
    assert not d0.eligible and d0.ejections == 1
    await proxy.client.close()


def test_request_failures_eject_a_worker_that_has_a_peer():
    reg, _, (d0, d1) = _cluster(1, 2, health_failures=2)
    reg.record_failure(d0, "boom")
    reg.record_failure(d0, "boom")
    assert not d0.eligible and d1.eligible
    reg.record_failure(d1, "boom")
    reg.record_failure(d1, "boom")
    assert d1.eligible  # now the last one


async def test_no_eligible_worker_waits_then_answers_503_with_retry_after():
    reg, _, (d0,) = _cluster(1, 1, health_failures=1)
    reg.record_failure(d0, "probe failed", probe=True)
    assert not d0.eligible

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=OK)

    proxy = _proxy(reg, handler, worker_wait_s=0.2)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    with pytest.raises(ProxyError) as e:
        await proxy.unary(parse_request("/generate", BODY))
    assert e.value.status == 503 and e.value.retry_after_s == 2 and "decode" in e.value.message
    assert loop.time() - t0 >= 0.2

    proxy.worker_wait_s = 30.0
    pending = asyncio.ensure_future(proxy.unary(parse_request("/generate", BODY)))
    while not reg._changed:  # the request is parked in wait_eligible
        await asyncio.sleep(0)
    reg.record_success(d0)  # a passing probe re-admits the decode
    status, _ = await asyncio.wait_for(pending, 5)
    assert status == 200 and loop.time() - t0 < 5
    await proxy.client.close()
