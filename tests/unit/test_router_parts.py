"""Router pieces without a network: config parsing, registry ejection, policies, request parsing,
logprob merging, SSE splitting, metrics text, pod -> worker mapping."""

from __future__ import annotations

import asyncio
import re

import pytest

from router.config import K8sConfig, RouterConfig, WorkerSpec, load_yaml, parse_worker_flag
from router.discovery_k8s import pod_worker
from router.main import build_parser, config_from_args
from router.metrics import RouterMetrics
from router.policies import CacheAware, LeastLoad, RoundRobin
from router.prefix_index import PrefixIndex
from router.protocol import BadRequest, merge_input_logprobs, parse_request
from router.proxy import Proxy
from router.registry import Registry
from router.sse import DONE, SSEReader, event_json


def test_worker_flags_and_validation():
    w = parse_worker_flag("http://10.0.0.1:30000/,bootstrap_port=9000", "prefill")
    assert (w.url, w.bootstrap_port, w.host) == ("http://10.0.0.1:30000", 9000, "10.0.0.1")
    assert parse_worker_flag("http://d:1", "decode").bootstrap_port is None
    for bad, role in [
        ("http://p:1,bootstrap_port=x", "prefill"),
        ("http://d:1,bootstrap_port=5", "decode"),
        ("p:1", "prefill"),
        ("http://p:1/v1", "prefill"),
        ("http://p:1,foo=1", "prefill"),
    ]:
        with pytest.raises(ValueError):
            parse_worker_flag(bad, role)
    with pytest.raises(ValueError, match="listed twice"):
        RouterConfig(workers=(WorkerSpec("http://a:1", "prefill"), WorkerSpec("http://a:1", "decode")))
    with pytest.raises(ValueError, match="--prefill-policy"):
        RouterConfig(prefill_policy="random")
    with pytest.raises(ValueError, match="--max-retries"):
        RouterConfig(max_retries=-1)


def test_yaml_config_and_flags_override(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text(
        "prefill:\n  - url: http://p:1\n    bootstrap_port: 8998\ndecode: [http://d:2]\n"
        "prefill_policy: cache_aware\nrequest_timeout: 30\n"
    )
    kw = load_yaml(f)
    assert kw["workers"][0].bootstrap_port == 8998 and kw["workers"][1].role == "decode"
    assert kw["prefill_policy"] == "cache_aware" and kw["request_timeout_s"] == 30
    ns = build_parser().parse_args(["--config", str(f), "--request-timeout", "5", "--decode", "http://d2:3"])
    cfg = config_from_args(ns)
    assert cfg.request_timeout_s == 5 and cfg.prefill_policy == "cache_aware"
    assert [w.url for w in cfg.workers] == ["http://d2:3"]  # flags replace the file's workers
    f.write_text("bogus: 1\n")
    with pytest.raises(ValueError, match="unknown key"):
        load_yaml(f)


def test_registry_ejects_after_threshold_and_readmits():
    ejected = []
    reg = Registry(health_failures=2, on_eject=ejected.append)
    w = reg.add(WorkerSpec("http://p:1", "prefill"))
    assert not w.eligible  # not probed yet
    reg.record_success(w)
    assert w.healthy and not w.eligible  # prefill without a bootstrap port
    w.bootstrap_port = 8998
    assert reg.eligible("prefill") == [w]
    reg.record_failure(w, "boom", probe=True)
    assert w.eligible
    reg.record_failure(w, "boom", probe=True)
    assert not w.eligible and ejected == [w] and w.ejections == 1
    reg.record_success(w)
    assert w.eligible and w.consecutive_failures == 0
    lease = reg.lease(w, 10)
    assert (w.outstanding_requests, w.outstanding_tokens) == (1, 10)
    lease.release()
    lease.release()
    assert (w.outstanding_requests, w.outstanding_tokens) == (0, 0)


def _workers(n: int):
    reg = Registry(1)
    ws = [reg.add(WorkerSpec(f"http://w{i}:1", "decode")) for i in range(n)]
    return reg, ws


def test_round_robin_and_least_load():
    _, ws = _workers(3)
    rr = RoundRobin()
    assert [rr.pick(ws, "").url for _ in range(4)] == [
        "http://w0:1",
        "http://w1:1",
        "http://w2:1",
        "http://w0:1",
    ]
    ws[0].outstanding_requests, ws[1].outstanding_requests = 2, 1
    assert LeastLoad().pick(ws, "") is ws[2]
    ws[2].outstanding_requests = 1
    ws[1].outstanding_tokens, ws[2].outstanding_tokens = 500, 100
    assert LeastLoad().pick(ws, "") is ws[2]  # ties on requests broken by tokens


def test_cache_aware_affinity_and_fallback():
    _, ws = _workers(4)
    ca = CacheAware(PrefixIndex(block_chars=16), threshold=0.3, abs_threshold=2, rel_threshold=1.5)
    system = "You are a helpful assistant. " * 3
    first = ca.pick(ws, system + "question one")
    assert all(ca.pick(ws, system + f"question {i}") is first for i in range(20))  # the shared prefix wins
    spread = {ca.pick(ws, f"{i} unrelated prompt of some length").url for i in range(40)}
    assert len(spread) == 4  # new prefixes go to the worker with the smallest tree
    first.outstanding_requests = 10  # unbalanced: fall back to the least loaded
    other = ca.pick(ws, system)
    assert other is not first
    first.outstanding_requests = 2  # within thresholds: the longest match wins over load
    assert ca.pick(ws, system + "question 5") is first  # `other` holds only the system prompt
    assert ca.pick(ws, system) is other  # both hold all of it: the less loaded


def test_cache_aware_follows_a_conversation():
    """Each turn extends the last: it lands where the conversation's earlier turns went, although an
    unrelated prompt that shares only the first block was routed elsewhere meanwhile."""
    _, ws = _workers(3)
    ca = CacheAware(PrefixIndex(block_chars=8), threshold=0.5)
    homes = {}
    for turn in range(6):
        for conv in range(6):
            prompt = "".join(f"conv {conv} turn {t}: some text. " for t in range(turn + 1))
            w = ca.pick(ws, prompt)
            assert homes.setdefault(conv, w) is w, (conv, turn)
    assert len({w.url for w in homes.values()}) == 3  # and the conversations spread over the workers


def test_prefix_index_matches_blocks_and_evicts_leaves_first():
    ix = PrefixIndex(max_chars=4 * 4, block_chars=4)
    a, b = ix.chain("aaaabbbbcccc"), ix.chain("aaaabbbbdddd")
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert ix.chain("aaaabbbbcc") == a[:2]  # a partial block is not named
    ix.insert("w", a, now=0)
    assert ix.matched("w", b) == 2 and ix.matched("w", a) == 3 and ix.matched("v", a) == 0
    ix.insert("w", b, now=1)  # 4 blocks held: a's first two, a's third, b's third
    ix.insert("w", ix.chain("eeee"), now=2)  # 5 > 4: the least recent leaf (a's third) goes
    assert ix.matched("w", a) == 2 and ix.matched("w", b) == 3 and ix.size("w") == 4
    ix.insert("v", a, now=1000)  # w idle past idle_s: its tree is dropped
    assert ix.size("w") == 0 and ix.matched("v", a) == 3


def test_prefill_here_hint_comes_from_the_router_only():
    r = parse_request("/generate", {"text": "hi", "pd_prefill_here": True})  # a client cannot set it
    assert "pd_prefill_here" not in r.decode_body("h", 1, 2) and "pd_prefill_here" not in r.prefill_body("h", 1, 2)
    assert r.decode_body("h", 1, 2, prefill_here=True)["pd_prefill_here"] is True
    metrics = RouterMetrics()
    proxy = Proxy(Registry(1), None, {}, metrics, 0, local_prefill_queue_tokens=100)
    _, (p,) = _workers(1)
    p.outstanding_tokens = 99
    assert not proxy._prefill_busy(p)
    p.outstanding_tokens = 100
    assert proxy._prefill_busy(p) and "pdserve_router_prefill_here_total 1.0" in metrics.render(Registry(1))
    assert not Proxy(Registry(1), None, {}, metrics, 0)._prefill_busy(p)  # 0: off


def test_parse_request_checks_and_estimates():
    r = parse_request(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}
    )
    assert not r.stream and r.max_new_tokens == 7 and "user" in r.prefix
    r = parse_request(
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 4},
            "stream": True,
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert r.stream and r.prompt_tokens == 3 and r.input_logprobs
    # SGLang's default logprob_start_len -1: output logprobs only, the prefill's answer is not awaited
    assert not parse_request("/generate", {"input_ids": [1], "return_logprob": True}).input_logprobs
    assert parse_request("/v1/completions", {"prompt": "a", "echo": True, "logprobs": 0}).input_logprobs
    body = r.prefill_body("h", 9, 123)
    assert body["stream"] is False and body["bootstrap_room"] == 123 and r.decode_body("h", 9, 1)["stream"]
    assert parse_request("/v1/completions", {"prompt": "x", "n": 2}).n == 2  # passed through (the services check it)
    assert parse_request("/generate", {"text": "x", "sampling_params": {"n": 4}}).n == 4
    assert parse_request("/generate", {"text": "x", "n": 4}).n == 1  # /generate's n is a sampling parameter
    bad = [
        ("/v1/completions", {"prompt": 3}),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}),
        ("/generate", {}),
        ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "9"}}),
        ("/generate", "x"),
    ]
    for endpoint, body in bad:
        with pytest.raises(BadRequest):
            parse_request(endpoint, body)


def test_router_validates_with_the_services_models():
    """One parser: the router refuses what the services refuse, with their message (common/api_requests.py),
    takes what they take (a whole number sent as 2.0 is 2; the forwarded body carries the int), and never
    forwards a number the JSON encoder cannot write (a float past int64 is not an integer)."""
    body = {"prompt": [1.0, 2], "n": 2.0, "max_tokens": 9.0}
    r = parse_request("/v1/completions", body)
    assert (r.n, r.max_new_tokens, r.prompt_tokens) == (2, 9, 2) and body["prompt"] == [1, 2] and type(body["n"]) is int
    for endpoint, bad, message in (
        ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, "unknown field 'sampling_params.bogus'"),
        ("/v1/completions", {"prompt": "x", "n": 65}, "'n' (choices per request) must be an integer in 1..64, got 65"),
        ("/generate", {"input_ids": [1.0e21]}, "'input_ids[0]' must be an integer"),
        ("/v1/chat/completions", {"messages": "hi"}, "'messages' must be a non-empty list"),
    ):
        with pytest.raises(BadRequest, match=re.escape(message)):
            parse_request(endpoint, bad)


def test_merge_input_logprobs():
    p = {"meta_info": {"input_token_logprobs": [[-1, 5, None]], "input_top_logprobs": [None]}}
    d = {"meta_info": {"input_token_logprobs": [[-2, 6, None]], "output_token_logprobs": [[-3, 7, None]]}}
    out = merge_input_logprobs("/generate", p, d)
    assert out["meta_info"]["input_token_logprobs"] == [[-1, 5, None], [-2, 6, None]]
    assert out["meta_info"]["input_top_logprobs"] == [None]
    assert out["meta_info"]["output_token_logprobs"] == [[-3, 7, None]]
    p = {"choices": [{"index": 0, "logprobs": {"tokens": ["a"], "token_logprobs": [None]}}]}
    d = {"choices": [{"index": 0, "logprobs": {"tokens": ["b"], "token_logprobs": [-0.1]}}]}
    assert merge_input_logprobs("/v1/completions", p, d)["choices"][0]["logprobs"]["tokens"] == ["a", "b"]


def test_sse_reader_splits_across_chunks():
    async def chunks():
        for c in [b'data: {"a"', b': 1}\n\n: keep-alive\n\ndata: {"a": 2}\r\n\r\ndata: [DO', b"NE]\n\n"]:
            yield c

    async def read():
        reader, out = SSEReader(chunks()), []
        while (ev := await reader.next_event()) is not None:
            out.append(event_json(ev))
        return out

    assert asyncio.run(read()) == [{"a": 1}, None, {"a": 2}, DONE]


def test_metrics_text():
    m = RouterMetrics()
    reg, ws = _workers(1)
    m.requests.inc(endpoint="/generate", status="200")
    m.ttft.observe(0.02)
    ws[0].outstanding_requests = 3
    text = m.render(reg)
    assert 'pdserve_router_requests_total{endpoint="/generate",status="200"} 1.0' in text
    assert 'pdserve_router_ttft_seconds_bucket{le="0.025"} 1.0' in text
    assert 'pdserve_router_worker_outstanding_requests{role="decode",url="http://w0:1"} 3.0' in text


def test_pod_worker_mapping():
    cfg = K8sConfig(selector="app=pdserve", worker_port=30000)
    pod = {
        "metadata": {
            "name": "p-0",
            "labels": {"pdserve.io/role": "prefill"},
            "annotations": {"pdserve.io/bootstrap-port": "8998"},
        },
        "status": {
            "phase": "Running",
            "podIP": "10.1.2.3",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    w = pod_worker(pod, cfg)
    assert (w.url, w.role, w.bootstrap_port) == ("http://10.1.2.3:30000", "prefill", 8998)
    not_ready = {**pod, "status": {**pod["status"], "conditions": [{"type": "Ready", "status": "False"}]}}
    deleting = {**pod, "metadata": {**pod["metadata"], "deletionTimestamp": "2024-01-01T00:00:00Z"}}
    no_role = {**pod, "metadata": {**pod["metadata"], "labels": {}}}
    assert pod_worker(not_ready, cfg) is None and pod_worker(deleting, cfg) is None
    assert pod_worker(no_role, cfg) is None
