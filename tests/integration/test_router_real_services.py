"""Acceptance 1: the `openai` client (chat and completions, streaming and not) through the router to
2 prefill + 2 decode real services (started by `pdserve up`, UCX transfer, embedded model) gets the
same greedy output as the colocated service. Then mid-stream migration: a decode killed (-9) while it
streams a chat and a completions answer; both streams continue on the other decode and equal an
unfailed run token for token, with one response id each, and every pool is back to 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from router_harness import ROOT, Proc, free_port, wait_for

from common.http import TOKEN_HEADER

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
ENGINE = ["--max-total-tokens", "8192", "--device", "cpu"]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    logs = tmp_path_factory.mktemp("up")
    colo_port, router_port = free_port(), free_port()
    colo = Proc(
        "colocated",
        [sys.executable, "-m", "pdserve", "colocated", "--port", str(colo_port), "--threads", "1", *ENGINE],
        f"http://127.0.0.1:{colo_port}",
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve",
            "up",
            "--prefill",
            "2",
            "--decode",
            "2",
            "--port",
            str(router_port),
            "--max-total-tokens",
            "8192",
            "--device",
            "cpu",
            "--transfer-backend",
            "ucx",
            "--worker-args",
            "--threads 1",
            "--log-dir",
            str(logs),
            "--startup-timeout",
            "600",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out: list[str] = []
        deadline = time.monotonic() + 660
        while not any("Ctrl-C stops everything" in ln for ln in out):
            line = up.stdout.readline()
            assert line or up.poll() is None, "pdserve up exited:\n" + "".join(out)
            assert time.monotonic() < deadline, "pdserve up not ready:\n" + "".join(out)
            out.append(line)
        colo.wait_healthy(600)
        yield f"http://127.0.0.1:{router_port}", colo.url, "".join(out), logs
    finally:
        up.send_signal(2)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        colo.stop()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


def _chat(c: openai.OpenAI, model: str, stream: bool) -> str:
    msgs = [{"role": "user", "content": "Name three primary colors."}]
    kw = {"model": model, "messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return c.chat.completions.create(**kw).choices[0].message.content
    return "".join(
        ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True) if ch.choices
    )


def _complete(c: openai.OpenAI, model: str, stream: bool) -> str:
    kw = {"model": model, "prompt": "The capital of France is", "max_tokens": MAX_TOKENS, "temperature": 0}
    if not stream:
        return c.completions.create(**kw).choices[0].text
    return "".join(ch.choices[0].text for ch in c.completions.create(**kw, stream=True) if ch.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_through_router_matches_colocated(services, stream):
    router_url, colo_url, _, _ = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    for _ in range(2):  # twice: least_load spreads the requests over both pairs
        expected = _chat(colo, model, stream)
        assert expected and _chat(via, model, stream) == expected
        expected = _complete(colo, model, stream)
        assert expected and _complete(via, model, stream) == expected


MIGRATE_TOKENS = 24
MIGRATE_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]},
    "/v1/completions": {"prompt": "The history of the Roman empire begins"},
}


def _sse(url: str, path: str, on_token=None) -> list[dict]:  # noqa: ANN001
    body = {**MIGRATE_BODIES[path], "model": "x", "max_tokens": MIGRATE_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    events: list[dict] = []
    with httpx.Client(timeout=300) as c, c.stream("POST", url + path, json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                if on_token is not None and events[-1].get("choices"):
                    on_token()
    return events


def _text(events: list[dict]) -> str:
    out = ""
    for e in events:
        for ch in e.get("choices") or []:
            out += ch["text"] if "text" in ch else ch["delta"].get("content") or ""
    return out


def _admin(url: str) -> dict[str, dict]:
    return {w["url"]: w for w in httpx.get(url + "/admin/workers").json()["workers"]}


def test_streams_migrate_off_a_killed_decode_and_equal_an_unfailed_run(services):
    router_url, _, up_out, logs = services
    decodes = dict(re.findall(r"started decode-\d+ pid (\d+): (\S+)", up_out))  # pid -> url
    (victim_pid, victim), (_, survivor) = decodes.items()
    with ThreadPoolExecutor(2) as ex:
        reference = dict(zip(MIGRATE_BODIES, ex.map(lambda p: _sse(router_url, p), MIGRATE_BODIES)))
    # both streams on one decode: take the other out of the router until they run, then kill theirs
    httpx.delete(router_url + "/admin/workers", params={"url": survivor}).raise_for_status()
    counts = {path: 0 for path in MIGRATE_BODIES}
    lock, running = threading.Lock(), threading.Event()

    def on_token(path: str) -> None:
        with lock:
            counts[path] += 1
            if min(counts.values()) >= 4 and not running.is_set():
                running.set()
                httpx.post(router_url + "/admin/workers", json={"url": survivor, "role": "decode"}).raise_for_status()
                os.killpg(int(victim_pid), signal.SIGKILL)

    with ThreadPoolExecutor(2) as ex:
        migrated = dict(zip(MIGRATE_BODIES, ex.map(lambda p: _sse(router_url, p, lambda: on_token(p)),
                                                   MIGRATE_BODIES)))
    assert running.is_set(), "the streams ended before the kill"
    for path in MIGRATE_BODIES:
        ref, got = reference[path], migrated[path]
        assert not any("error" in e for e in got), got[-2:]
        print(f"{path}: unfailed {_text(ref)!r}\n{' ' * len(path)}  migrated {_text(got)!r}")
        assert _text(got) == _text(ref) and got[-1]["usage"] == ref[-1]["usage"]
        assert len({e["id"] for e in got}) == 1 and not any("pd_token_ids" in e for e in got)
    metrics = httpx.get(router_url + "/metrics").text
    assert "pdserve_router_migrations_total 2.0" in metrics
    token = (Path(logs) / "internal-token").read_text().strip()

    def idle(url: str) -> bool:
        st = httpx.get(url + "/server_info", headers={TOKEN_HEADER: token}, timeout=10).json()["internal_states"][0]
        return st["kv_used_tokens"] == 0 and st.get("active_rooms", 0) == 0

    workers = [u for u, w in _admin(router_url).items() if u != victim]
    wait_for(lambda: all(idle(u) for u in workers), 60, "every pool back to 0", interval=0.2)
