"""Mid-stream migration with real services: a decode killed (-9) while it streams a greedy answer
through the router; the client's stream continues on another pair and equals an unfailed run, token
for token, with one response id; every pool is back to 0 after. One prefill, three decodes: each
test kills the decode carrying its stream, so both tests keep at least one decode alive."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from pd_harness import info, start_service, wait_idle
from router_harness import Proc, free_port

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
ENGINE = ["--max-total-tokens", "4096"]


@pytest.fixture(scope="module")
def cluster():
    procs: list[Proc] = []
    try:
        pre, boot = start_service("prefill", *ENGINE)
        procs.append(pre)
        decodes = [start_service("decode", *ENGINE)[0] for _ in range(3)]
        procs += decodes
        port = free_port()
        argv = [sys.executable, "-m", "pdserve", "router", "--port", str(port), "--health-interval", "0.5",
                "--prefill", f"{pre.url},bootstrap_port={boot}", "--log-level", "warning"]
        for d in decodes:
            argv += ["--decode", d.url]
        router = Proc("router", argv, f"http://127.0.0.1:{port}")
        procs.append(router)
        for p in procs:
            p.wait_healthy(600)
        yield router.url, pre, decodes
    finally:
        for p in procs:
            if p.alive():
                p.stop()


def _body(path: str) -> dict:
    common = {"model": "x", "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if path == "/v1/completions":
        return {**common, "prompt": "The history of the Roman empire begins"}
    return {**common, "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]}


def _stream(url: str, path: str, on_event=None) -> list[dict]:  # noqa: ANN001
    events: list[dict] = []
    with httpx.Client(timeout=120) as c, c.stream("POST", url + path, json=_body(path)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if on_event is not None:
                    on_event(events)
    return events


def _text(path: str, events: list[dict]) -> str:
    key = "text" if path == "/v1/completions" else "delta"
    parts = [e["choices"][0][key] for e in events if e.get("choices")]
    return "".join(p if isinstance(p, str) else p.get("content") or "" for p in parts)


def _carrier(url: str, decodes: list[Proc]) -> Proc:
    busy = [w["url"] for w in httpx.get(url + "/admin/workers").json()["workers"]
            if w["role"] == "decode" and w["outstanding_requests"] > 0]
    assert len(busy) == 1, busy
    return next(d for d in decodes if d.url == busy[0])


def _migrations(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("pdserve_router_migrations_total "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_stream_survives_a_killed_decode_and_equals_an_unfailed_run(cluster, path):
    url, pre, decodes = cluster
    reference = _stream(url, path)
    assert not any("error" in e for e in reference)
    before = _migrations(url)
    killed: list[Proc] = []

    def kill_after_tokens(events: list[dict]) -> None:
        if not killed and sum(1 for e in events if e.get("choices") and e["choices"][0].get("finish_reason")
                              is None) >= 4:
            killed.append(_carrier(url, decodes))
            killed[0].kill()  # SIGKILL the decode's process group, mid-stream

    migrated = _stream(url, path, kill_after_tokens)
    assert killed and not killed[0].alive()
    assert not any("error" in e for e in migrated), migrated[-3:]
    print(f"{path}: killed {killed[0].name} after 4 token events; unfailed {_text(path, reference)!r}; "
          f"migrated {_text(path, migrated)!r}; usage {migrated[-1]['usage']}")
    assert _text(path, migrated) == _text(path, reference)
    assert len({e["id"] for e in migrated}) == 1 and len({e["created"] for e in migrated}) == 1
    assert migrated[-1]["usage"] == reference[-1]["usage"]
    assert migrated[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert not any("pd_token_ids" in e for e in migrated)
    assert _migrations(url) == before + 1
    decodes.remove(killed[0])
    for proc in (pre, *decodes):
        wait_idle(proc)
    assert info(pre)["active_rooms"] == 0
    after = httpx.post(url + path, json={**_body(path), "stream": False, "max_tokens": 2}, timeout=120)
    assert after.status_code == 200, after.text
