"""The router's third role, `encoder` (E/P/D for vision-language models): image detection when a request is
parsed, the encoder in flags / config file / Kubernetes discovery / registry, and the proxy's dispatch and
failure rules for a triple. Workers are in-process httpx MockTransport handlers (as in
test_router_attribution.py); tests/integration/test_router_encoder.py checks the same over HTTP with stub
workers."""

from __future__ import annotations

import json

import httpx
import pytest

from router.client import WorkerClient
from router.config import RouterConfig, WorkerSpec, load_yaml, parse_worker_flag
from router.discovery_k8s import pod_worker
from router.health import HealthChecker
from router.main import build_parser, config_from_args
from router.metrics import RouterMetrics
from router.policies import make_policy
from router.protocol import fault_of, parse_request
from router.proxy import Proxy, ProxyError
from router.registry import Registry, Worker

IMAGE = "data:image/png;base64,iVBORw0KGgo="
CHAT_IMAGE = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                        {"type": "image_url", "image_url": {"url": IMAGE}}]}],
              "max_tokens": 4}
GEN_IMAGE = {"text": "describe", "image_data": IMAGE, "sampling_params": {"max_new_tokens": 4}}
TEXT = {"text": "hello there", "sampling_params": {"max_new_tokens": 4}}
OK = {"text": " ok", "meta_info": {"finish_reason": {"type": "length"}}}
ENCODED = {"bootstrap_room": 1, "images_sent": True}


# ---- parsing ------------------------------------------------------------------------------------------
def test_image_requests_are_detected_when_parsed():
    assert parse_request("/v1/chat/completions", CHAT_IMAGE).images
    assert parse_request("/generate", GEN_IMAGE).images
    assert parse_request("/generate", {**GEN_IMAGE, "image_data": [IMAGE, IMAGE]}).images
    text_parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    for endpoint, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", text_parts),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": "s"},
                                               {"role": "assistant", "content": None},
                                               {"role": "user", "content": "hi"}]}),
        ("/generate", TEXT),
        ("/generate", {**TEXT, "image_data": None}),
        ("/v1/completions", {"prompt": "hi"}),
    ]:
        assert not parse_request(endpoint, body).images, body
    # a later message's image counts too
    later = {"messages": [{"role": "user", "content": "hi"}, *CHAT_IMAGE["messages"]]}
    assert parse_request("/v1/chat/completions", later).images


def test_encoder_fields_on_the_bodies_come_from_the_router_only():
    req = parse_request("/v1/chat/completions", {**CHAT_IMAGE, "stream": True, "encoder_bootstrap_host": "evil",
                                                 "encoder_bootstrap_port": 1})
    e = req.encoder_body("e0", 9100, 7)
    assert (e["bootstrap_host"], e["bootstrap_port"], e["bootstrap_room"], e["stream"]) == ("e0", 9100, 7, False)
    assert "encoder_bootstrap_host" not in e and e["messages"] == CHAT_IMAGE["messages"]
    p = req.prefill_body("p0", 9000, 7, ("e0", 9100))
    assert (p["bootstrap_host"], p["bootstrap_port"], p["bootstrap_room"], p["stream"]) == ("p0", 9000, 7, False)
    assert (p["encoder_bootstrap_host"], p["encoder_bootstrap_port"]) == ("e0", 9100)
    for body in (req.prefill_body("p0", 9000, 7), req.decode_body("p0", 9000, 7)):
        assert "encoder_bootstrap_host" not in body and "encoder_bootstrap_port" not in body
    assert req.decode_body("p0", 9000, 7)["stream"] is True


def test_fault_may_name_the_encoder():
    assert fault_of({"error": {"message": "x", "fault": "encoder"}}) == "encoder"
    assert fault_of({"error": {"message": "x", "fault": "router"}}) == ""


# ---- configuration --------------------------------------------------------------------------------------
def test_encoder_flags_config_file_and_pods(tmp_path):
    w = parse_worker_flag("http://10.0.0.3:30000,bootstrap_port=8998", "encoder")
    assert (w.url, w.role, w.bootstrap_port) == ("http://10.0.0.3:30000", "encoder", 8998)
    assert parse_worker_flag("http://e:1", "encoder").bootstrap_port is None
    with pytest.raises(ValueError, match="worker role"):
        WorkerSpec("http://x:1", "vision")
    ns = build_parser().parse_args(["--prefill", "http://p:1", "--decode", "http://d:2", "--encoder", "http://e:3",
                                    "--encoder", "http://e2:4,bootstrap_port=9"])
    cfg = config_from_args(ns)
    assert [(s.role, s.url, s.bootstrap_port) for s in cfg.workers] == [
        ("prefill", "http://p:1", None), ("decode", "http://d:2", None), ("encoder", "http://e:3", None),
        ("encoder", "http://e2:4", 9)]
    with pytest.raises(ValueError, match="--embeddings-pool"):
        RouterConfig(embeddings_pool="encoder")

    f = tmp_path / "r.yaml"
    f.write_text("prefill: [http://p:1]\ndecode: [http://d:2]\nencoder:\n  - url: http://e:3\n    bootstrap_port: 77\n"
                 "  - http://e2:4\n")
    specs = load_yaml(f)["workers"]
    assert [(s.role, s.url, s.bootstrap_port) for s in specs][2:] == [("encoder", "http://e:3", 77),
                                                                      ("encoder", "http://e2:4", None)]

    cfg = config_from_args(build_parser().parse_args(["--k8s-selector", "app=x"])).k8s
    pod = {"metadata": {"name": "e-0", "labels": {"pdserve.io/role": "encoder"},
                        "annotations": {"pdserve.io/bootstrap-port": "8998"}},
           "status": {"phase": "Running", "podIP": "10.1.2.4", "conditions": [{"type": "Ready", "status": "True"}]}}
    spec = pod_worker(pod, cfg)
    assert (spec.url, spec.role, spec.bootstrap_port) == ("http://10.1.2.4:30000", "encoder", 8998)
    pod["metadata"]["labels"]["pdserve.io/role"] = "vision"
    assert pod_worker(pod, cfg) is None


async def test_an_encoder_is_eligible_once_its_bootstrap_port_is_known():
    reg = Registry(3)
    e = reg.add(WorkerSpec("http://127.0.0.1:7", "encoder"))

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        return httpx.Response(200, json={"role": "encoder", "served_model_name": "m", "bootstrap_port": 8998,
                                         "advertise_host": "10.0.0.9"})

    client = WorkerClient(None, 1.0, 5.0, http=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    reg.record_success(e)
    assert e.healthy and not e.eligible  # healthy, but a prefill cannot reach it yet
    assert await HealthChecker(reg, client, 1.0).probe(e)
    assert e.eligible and (e.bootstrap_host, e.bootstrap_port) == ("10.0.0.9", 8998)
    assert reg.eligible("encoder") == [e] and e.to_json()["role"] == "encoder"
    await client.close()


# ---- dispatch -------------------------------------------------------------------------------------------
def _cluster(encoders: int, prefills: int = 1, decodes: int = 1, health_failures: int = 3) -> tuple[Registry, dict]:
    reg = Registry(health_failures)
    ws: dict[str, Worker] = {}
    for i in range(prefills):
        ws[f"p{i}"] = reg.add(WorkerSpec(f"http://p{i}:1", "prefill", bootstrap_port=9000 + i))
    for i in range(decodes):
        ws[f"d{i}"] = reg.add(WorkerSpec(f"http://d{i}:1", "decode"))
    for i in range(encoders):
        ws[f"e{i}"] = reg.add(WorkerSpec(f"http://e{i}:1", "encoder", bootstrap_port=9100 + i))
    for w in ws.values():
        reg.record_success(w)
    return reg, ws


class Workers:
    """An httpx handler standing in for every worker: `answers[host]` (an error object, or a callable of the
    body) else OK (E: ENCODED); `posts` holds (host, body) of each proxied request, `aborts` (host, room)."""

    def __init__(self, answers: dict | None = None) -> None:
        self.answers = answers or {}
        self.posts: list[tuple[str, dict]] = []
        self.aborts: list[tuple[str, int]] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host, body = request.url.host, json.loads(request.content)
        if request.url.path == "/abort_request":
            self.aborts.append((host, body["bootstrap_room"]))
            return httpx.Response(200, json={})
        self.posts.append((host, body))
        answer = self.answers.get(host)
        if callable(answer):
            return answer(body)
        if answer is not None:
            if body.get("stream"):  # a stream's error is its first event
                return httpx.Response(200, content=b"data: " + json.dumps(answer).encode() + b"\n\ndata: [DONE]\n\n")
            return httpx.Response(answer["error"]["code"], json=answer)
        if host.startswith("e"):
            return httpx.Response(200, json=ENCODED)
        if body.get("stream"):
            return httpx.Response(200, content=b'data: {"text": " ok"}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, json=OK)

    def hosts(self) -> list[str]:
        return [h for h, _ in self.posts]

    def rooms(self, host: str) -> list[int]:
        return [b["bootstrap_room"] for h, b in self.posts if h == host]


def _proxy(reg: Registry, workers: Workers, retries: int = 2, migration_limit: int = 0) -> Proxy:
    client = WorkerClient(None, 1.0, 5.0, http=httpx.AsyncClient(transport=httpx.MockTransport(workers)))
    policies = {r: make_policy("round_robin", 256, 4, 1.5) for r in ("prefill", "decode")}
    return Proxy(reg, client, policies, RouterMetrics(), retries, migration_limit=migration_limit)


def _count(proxy: Proxy, name: str, **labels: str) -> float:
    return proxy.metrics.prom.get_sample_value(name, labels) or 0.0


def _err(code: int, message: str, **extra) -> dict:
    return {"error": {"message": message, "type": "server_error", "code": code, **extra}}


@pytest.mark.parametrize("stream", [False, True])
async def test_image_request_goes_encoder_prefill_decode_with_one_room(stream: bool):
    reg, ws = _cluster(encoders=1)
    workers = Workers()
    proxy = _proxy(reg, workers)
    req = parse_request("/v1/chat/completions", {**CHAT_IMAGE, "stream": stream})
    if stream:
        events = [e async for e in await proxy.stream(req)]
        assert b" ok" in events[0]
    else:
        assert (await proxy.unary(req))[0] == 200
    bodies = dict(workers.posts)
    assert sorted(bodies) == ["d0", "e0", "p0"]
    e, p, d = bodies["e0"], bodies["p0"], bodies["d0"]
    assert len({e["bootstrap_room"], p["bootstrap_room"], d["bootstrap_room"]}) == 1
    assert (e["bootstrap_host"], e["bootstrap_port"], e["stream"]) == ("e0", 9100, False)
    assert (p["bootstrap_host"], p["bootstrap_port"], p["stream"]) == ("p0", 9000, False)
    assert (p["encoder_bootstrap_host"], p["encoder_bootstrap_port"]) == ("e0", 9100)
    assert (d["bootstrap_host"], d["bootstrap_port"], d["stream"]) == ("p0", 9000, stream)
    assert "encoder_bootstrap_host" not in d and e["messages"] == CHAT_IMAGE["messages"]
    assert _count(proxy, "pdserve_router_image_requests_total", path="epd") == 1
    await proxy.client.close()
    assert not workers.aborts and ws["e0"].outstanding_requests == 0


async def test_text_requests_never_reach_an_encoder_and_encoders_take_turns():
    reg, ws = _cluster(encoders=2)
    workers = Workers()
    proxy = _proxy(reg, workers)
    for body in (TEXT, {"messages": [{"role": "user", "content": "hi"}]}):
        endpoint = "/generate" if "text" in body else "/v1/chat/completions"
        assert (await proxy.unary(parse_request(endpoint, body)))[0] == 200
    assert not [h for h in workers.hosts() if h.startswith("e")]
    assert _count(proxy, "pdserve_router_image_requests_total", path="epd") == 0
    for _ in range(4):
        assert (await proxy.unary(parse_request("/generate", GEN_IMAGE)))[0] == 200
    assert sorted(h for h in workers.hosts() if h.startswith("e")) == ["e0", "e0", "e1", "e1"]  # tie: rotation
    await proxy.client.close()


async def test_encoder_5xx_aborts_all_three_and_retries_on_another_encoder():
    reg, ws = _cluster(encoders=2)
    workers = Workers({"e0": _err(500, "tower crashed")})
    proxy = _proxy(reg, workers)
    assert (await proxy.unary(parse_request("/generate", GEN_IMAGE)))[0] == 200  # tied: e0 first, by URL
    assert [h for h in workers.hosts() if h.startswith("e")] == ["e0", "e1"]
    (room,) = workers.rooms("e0")
    assert workers.rooms("e1") != [room] and workers.rooms("p0") == [room, *workers.rooms("e1")]
    await proxy.client.close()  # waits for the aborts
    assert sorted(h for h, r in workers.aborts if r == room) == ["d0", "e0", "p0"]
    assert ws["e0"].consecutive_failures == 1 and ws["p0"].consecutive_failures == 0
    assert ws["d0"].consecutive_failures == 0
    assert _count(proxy, "pdserve_router_retries_total") == 1
    assert _count(proxy, "pdserve_router_image_requests_total", path="epd") == 1


async def test_prefill_blaming_its_encoder_counts_against_the_encoder():
    reg, ws = _cluster(encoders=2)

    def prefill(body: dict) -> httpx.Response:
        if body.get("encoder_bootstrap_host") == "e0":
            return httpx.Response(500, json=_err(500, "image embeddings never came", fault="encoder"))
        return httpx.Response(200, json=OK)

    workers = Workers({"p0": prefill})
    proxy = _proxy(reg, workers)
    assert (await proxy.unary(parse_request("/generate", GEN_IMAGE)))[0] == 200  # e0 first, then e1
    assert [h for h in workers.hosts() if h.startswith("e")] == ["e0", "e1"]
    assert ws["e0"].consecutive_failures == 1 and ws["p0"].consecutive_failures == 0
    # a text request's prefill naming an encoder it never had counts against the prefill itself
    workers.answers["p0"] = lambda body: httpx.Response(500, json=_err(500, "odd", fault="encoder"))
    with pytest.raises(ProxyError):
        await proxy.unary(parse_request("/generate", TEXT))
    assert ws["p0"].consecutive_failures == 3 and ws["e0"].consecutive_failures == 1
    await proxy.client.close()


async def test_encoder_4xx_is_relayed_not_retried():
    reg, ws = _cluster(encoders=2)
    workers = Workers({"e0": _err(400, "image 0: not an image"), "e1": _err(400, "image 0: not an image")})
    proxy = _proxy(reg, workers)
    with pytest.raises(ProxyError) as e:
        await proxy.unary(parse_request("/generate", GEN_IMAGE))
    assert e.value.status == 400 and e.value.message == "image 0: not an image"
    assert len([h for h in workers.hosts() if h.startswith("e")]) == 1
    assert all(w.consecutive_failures == 0 for w in ws.values())
    await proxy.client.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_busy_encoder_is_skipped_and_not_blamed(stream: bool):
    reg, ws = _cluster(encoders=2)
    workers = Workers({"e0": _err(503, "encoder queue full", retry_after=3)})
    proxy = _proxy(reg, workers)
    for _ in range(2):
        req = parse_request("/generate", {**GEN_IMAGE, "stream": stream})
        if stream:
            assert b" ok" in b"".join([e async for e in await proxy.stream(req)])
        else:
            assert (await proxy.unary(req))[0] == 200
    assert "e0" in workers.hosts() and ws["e0"].consecutive_failures == 0
    assert _count(proxy, "pdserve_router_worker_busy_total", role="encoder") == workers.hosts().count("e0")
    await proxy.client.close()


async def test_no_encoder_left_for_the_request_goes_prefill_decode():
    """No encoder eligible (none registered, all ejected) or every one failed/refused this request: P -> D,
    without waiting, counted as path pd."""
    reg, ws = _cluster(encoders=0)
    workers = Workers()
    proxy = _proxy(reg, workers)
    assert (await proxy.unary(parse_request("/v1/chat/completions", CHAT_IMAGE)))[0] == 200
    assert sorted(workers.hosts()) == ["d0", "p0"] and "encoder_bootstrap_host" not in dict(workers.posts)["p0"]
    assert _count(proxy, "pdserve_router_image_requests_total", path="pd") == 1

    reg, ws = _cluster(encoders=1)
    workers = Workers({"e0": _err(503, "transfer failed")})  # no retry_after: a failure
    proxy = _proxy(reg, workers)
    assert (await proxy.unary(parse_request("/generate", GEN_IMAGE)))[0] == 200
    assert workers.hosts().count("e0") == 1 and workers.hosts().count("p0") == 2  # the retry went P -> D
    assert ws["e0"].consecutive_failures == 1 and ws["e0"].eligible  # the last encoder is never ejected by requests
    assert _count(proxy, "pdserve_router_image_requests_total", path="pd") == 1
    assert _count(proxy, "pdserve_router_image_requests_total", path="epd") == 0
    await proxy.client.close()


async def test_a_migrated_image_stream_gets_a_new_encoder():
    reg, ws = _cluster(encoders=2, decodes=2)
    events = [{"text": "a", "meta_info": {}, "pd_token_ids": [5]},
              {"text": "a b", "meta_info": {}, "pd_token_ids": [6]}]
    cut = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)  # no [DONE]: the decode died

    def d0(body: dict) -> httpx.Response:
        return httpx.Response(200, content=cut)

    def d1(body: dict) -> httpx.Response:
        assert body["pd_resume"]["output_ids"] == [5, 6]
        done = {"text": "a b c", "meta_info": {"finish_reason": {"type": "length"}}, "pd_token_ids": [7]}
        return httpx.Response(200, content=b"data: " + json.dumps(done).encode() + b"\n\ndata: [DONE]\n\n")

    workers = Workers({"d0": d0, "d1": d1})
    proxy = _proxy(reg, workers, migration_limit=2)  # round robin: d0 first, the migration avoids it
    out = b"".join([e async for e in await proxy.stream(parse_request("/generate", {**GEN_IMAGE, "stream": True}))])
    assert b"a b c" in out and b"pd_token_ids" not in out and b"error" not in out
    assert [h for h in workers.hosts() if h.startswith("d")] == ["d0", "d1"]
    enc = [b for h, b in workers.posts if h.startswith("e")]
    assert len(enc) == 2 and "pd_resume" in enc[1]  # the new leg took an encoder too, with its own room
    p_rooms = workers.rooms("p0")
    assert [b["bootstrap_room"] for b in enc] == p_rooms and p_rooms[0] != p_rooms[1]
    assert _count(proxy, "pdserve_router_migrations_total") == 1
    assert _count(proxy, "pdserve_router_image_requests_total", path="epd") == 2  # one per leg
    await proxy.client.close()


async def test_traced_image_request_has_an_encoder_pick_span():
    import dataclasses

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    reg, ws = _cluster(encoders=1)
    workers = Workers()
    proxy = _proxy(reg, workers)
    try:
        root = tracing.start("router.request")
        for body in (GEN_IMAGE, TEXT):
            req = dataclasses.replace(parse_request("/generate", body), trace=root)
            assert (await proxy.unary(req))[0] == 200
        root.end()
    finally:
        await proxy.client.close()
        tracing.shutdown()
    spans = exporter.get_finished_spans()
    picks = [(s.attributes["role"], s.attributes["worker"]) for s in spans if s.name == "router.pick"]
    assert picks == [("prefill", "http://p0:1"), ("decode", "http://d0:1"), ("encoder", "http://e0:1"),
                     ("prefill", "http://p0:1"), ("decode", "http://d0:1")]  # the text request picks no encoder
    attempts = [s.attributes for s in spans if s.name == "router.attempt"]
    assert attempts[0]["encoder"] == "http://e0:1" and "encoder" not in attempts[1]
    assert set(workers.hosts()) == {"e0", "p0", "d0"}


def test_routing_text_holds_an_images_digest_not_its_bytes():
    from router.protocol import parse_request

    def req(url: str):  # noqa: ANN202
        body = {"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]}
        return parse_request("/v1/chat/completions", body)

    big, other = "data:image/png;base64," + "A" * 100_000, "data:image/png;base64," + "B" * 100_000
    a, b = req(big), req(other)
    assert len(a.prefix) < 300 and a.prefix != b.prefix and req(big).prefix == a.prefix
    assert a.prompt_tokens < 100  # the load estimate does not count the base64
