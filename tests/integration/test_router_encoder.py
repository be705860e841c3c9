"""E/P/D through the router against stub workers in real processes (one stack: encoders e0, e1, prefill p0,
decode d0): an image request reaches E, P and D at once with one room (E's bootstrap server on P's body); a
text request never reaches an encoder; an encoder's 5xx aborts the room on all three and is retried on the
other encoder, counted against the failed one; an encoder's 4xx is relayed; with no encoder an image request
goes P -> D. The stub prefill waits for the encoder's room as a stub decode waits for the prefill's."""

from __future__ import annotations

import httpx
import pytest
from router_harness import control, start_router, start_stub, stub_state, wait_for

pytestmark = pytest.mark.slow

IMAGE = "data:image/png;base64,iVBORw0KGgo="
CHAT_IMAGE = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                        {"type": "image_url", "image_url": {"url": IMAGE}}]}],
              "max_tokens": 3}
GEN_IMAGE = {"text": "describe", "image_data": [IMAGE], "sampling_params": {"max_new_tokens": 3}}
ENCODERS = ("e0", "e1")
STUBS = (*ENCODERS, "p0", "d0")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def cluster():
    procs = {name: start_stub("encoder" if name in ENCODERS else "prefill" if name == "p0" else "decode")
             for name in STUBS}
    # --health-failures 1: one failed request ejects an encoder that has a peer (the ejection is the test's
    # lasting record of a failure counted against it; the next probe re-admits it)
    args = ["--request-timeout", "10", "--max-retries", "2", "--health-failures", "1", "--worker-wait", "2",
            "--prefill", procs["p0"].url, "--decode", procs["d0"].url,
            "--encoder", procs["e0"].url, "--encoder", procs["e1"].url + f",bootstrap_port={_port(procs['e1'].url)}"]
    procs["router"] = start_router(args)
    try:
        for p in procs.values():
            p.wait_healthy(60)
        wait_for(lambda: _all_eligible(procs["router"].url), 30, "all workers admitted")
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _workers(url: str) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(url + "/admin/workers").json()["workers"]}


def _all_eligible(url: str) -> bool:
    ws = _workers(url)
    return len(ws) == len(STUBS) and all(w["eligible"] for w in ws.values())


@pytest.fixture(autouse=True)
def reset(cluster):
    yield
    url = cluster["router"].url
    for name in STUBS:
        control(cluster[name], "ok")
    for name in ENCODERS:  # a test may have removed them
        if cluster[name].url not in _workers(url):
            httpx.post(url + "/admin/workers", json={"url": cluster[name].url, "role": "encoder"}).raise_for_status()
    wait_for(lambda: _all_eligible(url), 10, "all workers eligible again")


class Seen:
    """The request bodies each stub got since this was made."""

    def __init__(self, cluster: dict) -> None:
        self.cluster = cluster
        self.start = {name: len(stub_state(cluster[name])["bodies"]) for name in STUBS}

    def new(self, name: str) -> list[dict]:
        return stub_state(self.cluster[name])["bodies"][self.start[name]:]

    def encoders(self) -> dict[str, list[dict]]:
        return {name: bodies for name in ENCODERS if (bodies := self.new(name))}


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("endpoint, body", [("/v1/chat/completions", CHAT_IMAGE),
                                            ("/generate", {**GEN_IMAGE, "stream": True})])
def test_image_request_reaches_encoder_prefill_and_decode_with_one_room(cluster, endpoint, body):
    url = cluster["router"].url
    seen = Seen(cluster)
    epd = _metric(url, 'pdserve_router_image_requests_total{path="epd"}')
    r = httpx.post(url + endpoint, json=body, timeout=30)
    assert r.status_code == 200, r.text
    if body.get("stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
    else:
        assert len(r.json()["choices"][0]["message"]["content"].split()) == 3
    ((name, (e,)),) = seen.encoders().items()  # exactly one encoder, once
    (p,), (d,) = seen.new("p0"), seen.new("d0")
    room = e["bootstrap_room"]
    assert p["bootstrap_room"] == room and d["bootstrap_room"] == room
    enc = cluster[name].url
    assert (e["bootstrap_host"], e["bootstrap_port"], e["stream"]) == ("127.0.0.1", _port(enc), False)
    assert (p["encoder_bootstrap_host"], p["encoder_bootstrap_port"]) == ("127.0.0.1", _port(enc))
    assert (p["bootstrap_port"], p["stream"]) == (_port(cluster["p0"].url), False)
    assert d["bootstrap_port"] == _port(cluster["p0"].url) and "encoder_bootstrap_host" not in d
    assert d.get("stream") == body.get("stream")  # D's body is the client's (plus the bootstrap fields)
    assert _metric(url, 'pdserve_router_image_requests_total{path="epd"}') == epd + 1
    # encoders are listed, probed and counted like the other roles
    workers = _workers(url)
    assert workers[enc]["role"] == "encoder" and workers[enc]["bootstrap_port"] == _port(enc)
    assert httpx.get(url + "/health").json()["eligible_workers"] == {"prefill": 1, "decode": 1, "encoder": 2}
    assert f'pdserve_router_worker_healthy{{role="encoder",url="{enc}"}} 1.0' in httpx.get(url + "/metrics").text


def test_text_request_never_reaches_an_encoder(cluster):
    url = cluster["router"].url
    seen = Seen(cluster)
    for endpoint, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
                           ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}, "stream": True}),
                           ("/v1/completions", {"prompt": "hi", "max_tokens": 2})]:
        assert httpx.post(url + endpoint, json=body, timeout=30).status_code == 200
    assert len(seen.new("p0")) == 3 and not seen.encoders()
    assert all("encoder_bootstrap_host" not in b for b in seen.new("p0"))


def test_encoder_5xx_is_retried_on_the_other_encoder_and_counted_against_it(cluster):
    url, e0 = cluster["router"].url, cluster["e0"]
    control(e0, "fail")
    retries = _metric(url, "pdserve_router_retries_total")
    seen = Seen(cluster)
    for _ in range(4):  # until the rotation gives e0 one (the first or second request)
        r = httpx.post(url + "/generate", json=GEN_IMAGE, timeout=30)
        assert r.status_code == 200, r.text
        if seen.new("e0"):
            break
    (failed,) = [b["bootstrap_room"] for b in seen.new("e0")]
    served = seen.new("e1")[-1]["bootstrap_room"]
    assert served != failed and [b["bootstrap_room"] for b in seen.new("p0")][-2:] == [failed, served]
    for name in ("e0", "p0", "d0"):  # the failed room was aborted on all three
        wait_for(lambda n=name: failed in stub_state(cluster[n])["aborted"], 10, f"room aborted on {name}")
    assert _metric(url, "pdserve_router_retries_total") == retries + 1
    assert _metric(url, f'pdserve_router_ejections_total{{role="encoder",url="{e0.url}"}}') >= 1
    assert _metric(url, f'pdserve_router_ejections_total{{role="prefill",url="{cluster["p0"].url}"}}') == 0


def test_encoder_4xx_is_relayed_not_retried(cluster):
    url = cluster["router"].url
    for name in ENCODERS:
        control(cluster[name], "reject")
    seen = Seen(cluster)
    r = httpx.post(url + "/v1/chat/completions", json=CHAT_IMAGE, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"] == "encoder stub told to reject the request"
    assert sum(len(b) for b in seen.encoders().values()) == 1


def test_without_an_encoder_an_image_request_goes_prefill_decode(cluster):
    url = cluster["router"].url
    for name in ENCODERS:
        assert httpx.delete(url + "/admin/workers", params={"url": cluster[name].url}).status_code == 200
    pd = _metric(url, 'pdserve_router_image_requests_total{path="pd"}')
    seen = Seen(cluster)
    r = httpx.post(url + "/generate", json=GEN_IMAGE, timeout=30)
    assert r.status_code == 200 and len(r.json()["text"].split()) == 3
    (p,), (d,) = seen.new("p0"), seen.new("d0")
    assert not seen.encoders() and "encoder_bootstrap_host" not in p and p["bootstrap_room"] == d["bootstrap_room"]
    assert _metric(url, 'pdserve_router_image_requests_total{path="pd"}') == pd + 1
    # an encoder added through the admin API (bootstrap port from its /server_info) is used again
    added = httpx.post(url + "/admin/workers", json={"url": cluster["e0"].url, "role": "encoder"})
    assert added.status_code == 200, added.text
    assert added.json()["role"] == "encoder" and added.json()["eligible"]
    assert added.json()["bootstrap_port"] == _port(cluster["e0"].url)
    assert httpx.post(url + "/generate", json=GEN_IMAGE, timeout=30).status_code == 200
    assert seen.new("e0")
