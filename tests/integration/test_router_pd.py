"""Router against stub prefill/decode workers in real processes: OpenAI client output equals the
colocated stub's, retries with room aborts, timeouts, client disconnects, auth, bad input, admin API."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from router_harness import control, start_router, start_stub, stub_state, wait_for

pytestmark = pytest.mark.slow

TOKEN = "internal-secret"
KEY = "client-key-1"


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    d = tmp_path_factory.mktemp("router")
    (d / "keys").write_text(f"# keys\n{KEY}\n")
    (d / "token").write_text(TOKEN + "\n")
    procs = {
        "p0": start_stub("prefill", token=TOKEN),
        "p1": start_stub("prefill", token=TOKEN),
        "d0": start_stub("decode", token=TOKEN, token_delay=0.01),
        "d1": start_stub("decode", token=TOKEN, token_delay=0.01),
        "colo": start_stub("colocated"),
    }
    args = [
        "--api-key-file",
        str(d / "keys"),
        "--internal-token-file",
        str(d / "token"),
        "--request-timeout",
        "3",
        "--max-retries",
        "2",
        "--health-failures",
        "2",
        "--prefill",
        procs["p0"].url,
        "--prefill",
        procs["p1"].url + f",bootstrap_port={_port(procs['p1'].url)}",
        "--decode",
        procs["d0"].url,
        "--decode",
        procs["d1"].url,
    ]
    procs["router"] = start_router(args)
    try:
        for p in procs.values():
            p.wait_healthy(60)
        # /health needs one prefill and one decode; tests that use both pairs need every worker admitted
        # (a prefill becomes eligible once a probe has read its bootstrap port)
        wait_for(lambda: _all_admitted(procs["router"].url, 4), 30, "all workers admitted")
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _all_admitted(url: str, n: int) -> bool:
    ws = httpx.get(url + "/admin/workers", headers={"Authorization": f"Bearer {KEY}"}).json()["workers"]
    return len(ws) == n and all(w["eligible"] for w in ws)


@pytest.fixture(autouse=True)
def reset_modes(cluster):
    yield
    for name in ("p0", "p1", "d0", "d1"):
        control(cluster[name], "ok")
    wait_for(lambda: httpx.get(cluster["router"].url + "/health").status_code == 200, 10, "router healthy")


def _client(url: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


MSGS = [{"role": "user", "content": "Name three colors."}]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_chat_and_completions_match_colocated(cluster, stream):
    via, colo = _client(cluster["router"].url), _client(cluster["colo"].url)

    def chat(c):
        if not stream:
            return (
                c.chat.completions.create(model="stub-model", messages=MSGS, max_tokens=8)
                .choices[0]
                .message.content
            )
        parts = c.chat.completions.create(model="stub-model", messages=MSGS, max_tokens=8, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in parts)

    def complete(c):
        if not stream:
            return c.completions.create(model="stub-model", prompt="Once upon", max_tokens=6).choices[0].text
        parts = c.completions.create(model="stub-model", prompt="Once upon", max_tokens=6, stream=True)
        return "".join(ch.choices[0].text for ch in parts)

    for _ in range(2):  # both pairs get used by least_load + rotation
        assert chat(via) == chat(colo) and len(chat(via).split()) == 8
        assert complete(via) == complete(colo)
    # every room a decode saw was also sent to a prefill, and rooms are 63-bit
    rooms_d = set(stub_state(cluster["d0"])["rooms"]) | set(stub_state(cluster["d1"])["rooms"])
    rooms_p = set(stub_state(cluster["p0"])["rooms"]) | set(stub_state(cluster["p1"])["rooms"])
    assert rooms_d and rooms_d <= rooms_p
    assert all(0 <= r < 2**63 for r in rooms_d)
    assert stub_state(cluster["p0"])["rooms"] and stub_state(cluster["p1"])["rooms"]


def test_generate_merges_input_logprobs(cluster):
    body = {"text": "hello", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True, "logprob_start_len": 0}
    r = httpx.post(cluster["router"].url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["input_token_logprobs"] == [[-0.5, i, None] for i in range(3)]
    body["stream"] = True
    with httpx.stream(
        "POST", cluster["router"].url + "/generate", json=body, headers={"Authorization": f"Bearer {KEY}"}
    ) as r:
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[0])["meta_info"]["input_token_logprobs"] == [[-0.5, i, None] for i in range(3)]


def test_prefill_failure_retries_and_aborts_decode_room(cluster):
    before = len(stub_state(cluster["p0"])["rooms"])
    control(cluster["p0"], "fail")
    for _ in range(4):
        out = _client(cluster["router"].url).completions.create(model="m", prompt="x", max_tokens=2)
        assert len(out.choices[0].text.split()) == 2
    failed = set(stub_state(cluster["p0"])["rooms"][before:])
    assert failed, "p0 got at least one request while failing"

    def decode_aborted() -> set:
        return set(stub_state(cluster["d0"])["aborted"]) | set(stub_state(cluster["d1"])["aborted"])

    wait_for(lambda: failed <= decode_aborted(), 5, "failed rooms aborted on the decode side")
    metrics = httpx.get(cluster["router"].url + "/metrics").text
    assert "pdserve_router_retries_total" in metrics and "pdserve_router_retries_total 0" not in metrics


def test_hanging_decode_times_out_and_retries(cluster):
    before = len(stub_state(cluster["d0"])["rooms"])
    control(cluster["d0"], "hang")
    for _ in range(2):
        out = _client(cluster["router"].url).chat.completions.create(model="m", messages=MSGS, max_tokens=2)
        assert len(out.choices[0].message.content.split()) == 2
    hung = set(stub_state(cluster["d0"])["rooms"][before:])
    assert hung, "the hanging decode was tried at least once"
    wait_for(lambda: hung <= set(stub_state(cluster["d0"])["aborted"]), 5, "hung rooms aborted")


def test_all_prefills_failing_gives_clean_502(cluster):
    control(cluster["p0"], "fail")
    control(cluster["p1"], "fail")
    with pytest.raises(openai.APIStatusError) as e:
        _client(cluster["router"].url).completions.create(model="m", prompt="x", max_tokens=2)
    assert e.value.status_code in (502, 503)
    assert httpx.get(cluster["router"].url + "/livez").status_code == 200


def test_streaming_client_disconnect_aborts_both_sides(cluster):
    names = ("p0", "p1", "d0", "d1")
    before = {n: set(stub_state(cluster[n])["rooms"]) for n in names}
    body = {"text": "disconnect me", "sampling_params": {"max_new_tokens": 500}, "stream": True}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", cluster["router"].url + "/generate", json=body, headers=auth) as r:
        first = next(ln for ln in r.iter_lines() if ln.startswith("data: "))
    assert "text" in json.loads(first[6:])
    new = {n: set(stub_state(cluster[n])["rooms"]) - before[n] for n in names}
    (room,) = new["d0"] | new["d1"]
    assert room in new["p0"] | new["p1"]

    def aborted_on_both() -> bool:
        return sum(room in stub_state(cluster[n])["aborted"] for n in names) == 2

    wait_for(aborted_on_both, 10, "room aborted on prefill and decode")


def test_bad_input_and_auth_give_4xx_and_router_stays_healthy(cluster):
    url = cluster["router"].url
    auth = {"Authorization": f"Bearer {KEY}"}
    cases = [
        ({}, b'{"messages": []}', "/v1/chat/completions", 401, "missing API key"),
        ({"Authorization": "Bearer nope"}, b'{"prompt": "x"}', "/v1/completions", 401, "invalid API key"),
        (auth, b"{not json", "/v1/completions", 400, "not valid JSON"),
        (auth, b'{"messages": []}', "/v1/chat/completions", 400, "messages"),
        (auth, b'{"prompt": "x", "stream": "yes"}', "/v1/completions", 400, "stream"),
        (auth, b'{"prompt": ["a", "b"]}', "/v1/completions", 400, "one prompt"),
        (auth, b'{"text": "a", "input_ids": [1]}', "/generate", 400, "exactly one"),
        (auth, b'{"prompt": "x", "max_tokens": -1}', "/v1/completions", 400, "max_tokens"),
        (
            auth,
            b'{"prompt": "x", "max_tokens": 5000}',
            "/v1/completions",
            400,
            "too large",
        ),  # from the worker
        (auth, b"[1, 2]", "/generate", 400, "JSON object"),
    ]
    for headers, raw, path, status, needle in cases:
        r = httpx.post(url + path, content=raw, headers={**headers, "content-type": "application/json"})
        assert r.status_code == status, (path, raw, r.text)
        assert needle in r.json()["error"]["message"], r.text
    # n > 1 passes through: the services validate n (their 400 is relayed; test_router_real_services)
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "n": 3}, headers=auth)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.AuthenticationError):
        _client(url, key="wrong").models.list()
    assert [m.id for m in _client(url).models.list().data] == ["stub-model"]
    assert httpx.get(url + "/health").status_code == 200
    assert 'status="401"' in httpx.get(url + "/metrics").text


def test_admin_api_remove_and_add_worker(cluster):
    url, auth = cluster["router"].url, {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(url + "/admin/workers").status_code == 401
    p1 = cluster["p1"].url
    assert httpx.delete(url + "/admin/workers", params={"url": p1}, headers=auth).status_code == 200
    listed = httpx.get(url + "/admin/workers", headers=auth).json()["workers"]
    assert p1 not in [w["url"] for w in listed] and len(listed) == 3
    r = httpx.post(url + "/admin/workers", json={"url": p1, "role": "prefill"}, headers=auth)
    assert r.status_code == 200 and r.json()["eligible"] and r.json()["bootstrap_port"] == _port(p1)
    r = httpx.post(url + "/admin/workers", json={"url": "ftp://x", "role": "prefill"}, headers=auth)
    assert r.status_code == 400 and "http://host:port" in r.json()["error"]["message"]
    r = httpx.post(url + "/admin/workers", json={"url": "http://x:1", "role": "middle"}, headers=auth)
    assert r.status_code == 400
    assert (
        httpx.delete(url + "/admin/workers", params={"url": "http://nope:1"}, headers=auth).status_code == 404
    )


def test_unhealthy_worker_is_ejected_and_readmitted(cluster):
    url, auth = cluster["router"].url, {"Authorization": f"Bearer {KEY}"}

    def eligible(u: str) -> bool:
        ws = httpx.get(url + "/admin/workers", headers=auth).json()["workers"]
        return next(w for w in ws if w["url"] == u)["eligible"]

    control(cluster["d1"], "unhealthy")
    wait_for(lambda: not eligible(cluster["d1"].url), 10, "d1 ejected")
    assert 'pdserve_router_ejections_total{role="decode"' in httpx.get(url + "/metrics").text
    control(cluster["d1"], "ok")
    wait_for(lambda: eligible(cluster["d1"].url), 10, "d1 re-admitted")


def test_several_router_processes_serve_and_refuse_admin_changes(cluster, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    router = start_router(
        ["--workers", "2", "--internal-token-file", str(tmp_path / "token")]
        + ["--prefill", cluster["p0"].url, "--decode", cluster["d0"].url]
    )
    try:
        router.wait_healthy(60)
        body = {"text": "two processes", "sampling_params": {"max_new_tokens": 3}}
        for _ in range(10):  # new connections: the kernel spreads them over both processes
            r = httpx.post(router.url + "/generate", json=body, timeout=30)
            assert r.status_code == 200 and len(r.json()["text"].split()) == 3
        with httpx.stream("POST", router.url + "/generate", json={**body, "stream": True}, timeout=30) as r:
            assert r.status_code == 200 and r.read().rstrip().endswith(b"data: [DONE]")
        r = httpx.post(router.url + "/admin/workers", json={"url": cluster["p1"].url, "role": "prefill"})
        assert r.status_code == 409 and "--workers" in r.json()["error"]["message"]
    finally:
        router.stop()
