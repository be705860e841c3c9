"""Acceptance 1: the `openai` client (chat and completions, streaming and not) through the router to
2 prefill + 2 decode real services (started by `pdserve up`, UCX transfer, embedded model) gets the
same greedy output as the colocated service."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import openai
import pytest
from router_harness import ROOT, Proc, free_port

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
        yield f"http://127.0.0.1:{router_port}", colo.url
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
    router_url, colo_url = services
    via, colo = _client(router_url), _client(colo_url)
    model = via.models.list().data[0].id
    for _ in range(2):  # twice: least_load spreads the requests over both pairs
        expected = _chat(colo, model, stream)
        assert expected and _chat(via, model, stream) == expected
        expected = _complete(colo, model, stream)
        assert expected and _complete(via, model, stream) == expected
