"""`pdserve up` with default flags under the burst a load generator sends (issue: 113 of 114 requests
failed): 4 concurrent streaming chat requests, content as a list of text parts, usage in the stream,
`max_completion_tokens`, `ignore_eos`, three rounds, all through the router to the real embedded
model over real UCX. Every request must succeed, whole, with no error event."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from router_harness import ROOT, free_port

pytestmark = pytest.mark.slow

WORDS = " ".join(["lorem ipsum dolor sit amet"] * 30)
MAX_TOKENS = 32


def _body(i: int) -> dict:
    return {
        "model": "embedded:smollm2-135m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": f"{i} {WORDS}"}]}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": MAX_TOKENS,
        "ignore_eos": True,
    }


async def _one(c: httpx.AsyncClient, url: str, i: int) -> dict:
    t0 = time.monotonic()
    ttft, events, done = None, [], False
    async with c.stream("POST", url + "/v1/chat/completions", json=_body(i)) as r:
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                ttft = ttft if ttft is not None else time.monotonic() - t0
                events.append(json.loads(line[6:]))
        return {"status": r.status_code, "ttft": ttft, "e2e": time.monotonic() - t0, "events": events, "done": done}


async def _rounds(url: str) -> list[list[dict]]:
    async with httpx.AsyncClient(timeout=300) as c:
        return [list(await asyncio.gather(*(_one(c, url, 10 * rnd + i) for i in range(4)))) for rnd in range(3)]


def test_up_default_flags_serves_a_concurrent_streaming_burst(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--port", str(port), "--log-dir", str(tmp_path), "--grace", "5"],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 600
        while not any("Ctrl-C stops everything" in ln for ln in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stdout.readline())
        # the workers split the CPUs this test may use instead of each taking all of them
        m = re.search(r"--threads (\d+) \((\d+) CPUs, 2 ranks\)", "".join(lines))
        assert m and int(m.group(1)) == max(1, int(m.group(2)) // 2), "".join(lines)

        rounds = asyncio.run(_rounds(f"http://127.0.0.1:{port}"))
        for n, res in enumerate(rounds):
            print(f"round {n}: " + ", ".join(f"{r['status']} ttft {r['ttft']:.2f}s e2e {r['e2e']:.2f}s" for r in res))
        for res in rounds:
            for r in res:
                assert r["status"] == 200 and r["done"], r
                assert not [e for e in r["events"] if "error" in e], r["events"]
                text = [c["delta"].get("content", "") for e in r["events"] for c in e.get("choices", [])]
                # streamed in pieces, not one blob; not one piece per token: the request samples at the
                # default temperature, and tokens that decode to no text (special tokens past ignore_eos,
                # partial UTF-8) send no delta, so the count of pieces varies from run to run
                assert sum(1 for t in text if t) >= 2 and "".join(text).strip(), text
                usage = [e["usage"] for e in r["events"] if e.get("usage")]
                assert usage and usage[-1]["completion_tokens"] == MAX_TOKENS
        router_log = (tmp_path / "router.log").read_text()
        assert "worker ejected" not in router_log, router_log[-3000:]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
