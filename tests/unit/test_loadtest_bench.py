"""`pdserve bench` end to end against the stand-in OpenAI SSE server (a real process, real sockets)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from common.procs import free_port
from loadtest.cli import main

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def start_standin(*flags: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "loadtest.standin", "--port", str(port), *flags], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, "stand-in exited"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.05)  # poll interval while the server binds
    proc.kill()
    raise AssertionError("stand-in did not come up")


@pytest.fixture(scope="module")
def standin():
    proc, url = start_standin("--ttft", "0.02", "--itl", "0.01")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def flaky():
    proc, url = start_standin("--fail-every", "2", "--itl", "0.001")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def read(out: Path) -> dict:
    doc = json.loads((out / "bench.json").read_text())
    for png in ("latency_cdf.png", "itl_over_time.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC
    return doc


@pytest.mark.slow
def test_poisson_completions_writes_json_and_plots(standin, tmp_path):
    rc = main(["--url", standin, "--num-requests", "12", "--request-rate", "40", "--input-len", "16",
               "--output-len", "8", "--out", str(tmp_path), "--slo-ttft", "10", "--no-progress"])
    assert rc == 0
    doc = read(tmp_path)
    s = doc["summary"]
    assert (s["completed"], s["failed"], s["short_outputs"]) == (12, 0, 0)
    assert s["output_tokens"] == 96 and s["input_tokens"] == 12 * 16
    assert s["good_requests"] == 12
    assert 0.005 < s["itl_s"]["p50"] < 0.05  # the stand-in paces tokens 10 ms apart
    assert 0.02 <= s["ttft_s"]["min"] < 1.0
    assert doc["config"]["client"]["model"] == "standin"  # asked /v1/models
    starts = sorted(r["start"] for r in doc["requests"])
    assert starts[-1] - starts[0] > 0.05  # Poisson pacing spread the sends
    assert all(r["server_prompt_tokens"] == 16 for r in doc["requests"])


@pytest.mark.slow
def test_chat_with_concurrency_cap(standin, tmp_path):
    rc = main(["--url", standin, "--endpoint", "chat", "--num-requests", "6", "--concurrency", "2",
               "--output-len", "5", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    reqs = read(tmp_path)["requests"]
    assert all(r["output_tokens"] == 5 and len(r["chunk_times"]) == 5 for r in reqs)
    events = sorted([(r["start"], 1) for r in reqs] + [(r["end"], -1) for r in reqs])  # ends sort first
    inflight = peak = 0
    for _, d in events:
        inflight += d
        peak = max(peak, inflight)
    assert peak == 2


@pytest.mark.slow
def test_duration_bounds_the_run(standin, tmp_path):
    t = time.monotonic()
    rc = main(["--url", standin, "--num-requests", "3", "--concurrency", "2", "--duration", "0.6",
               "--output-len", "4", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    assert time.monotonic() - t < 10
    doc = read(tmp_path)
    assert doc["summary"]["num_requests"] > 3  # the 3 prompts were cycled
    assert max(r["start"] for r in doc["requests"]) < 0.6 + 0.2


@pytest.mark.slow
def test_failures_are_counted_and_exit_nonzero(flaky, tmp_path):
    rc = main(["--url", flaky, "--num-requests", "6", "--output-len", "3", "--out", str(tmp_path),
               "--no-progress"])
    assert rc == 1
    s = read(tmp_path)["summary"]
    assert s["failed"] == 3 and s["completed"] == 3
    assert any("HTTP 500" in e for e in s["errors"])


def test_bad_flags_and_unreachable_url(capsys):
    assert main(["--url", "http://127.0.0.1:9", "--request-rate", "0", "--num-requests", "1"]) == 2
    assert "request-rate" in capsys.readouterr().err
    assert main(["--url", "ftp://x", "--num-requests", "1"]) == 2
    port = free_port()  # nothing listens there
    assert main(["--url", f"http://127.0.0.1:{port}", "--num-requests", "1", "--no-progress"]) == 2
    assert "ConnectError" in capsys.readouterr().err


@pytest.mark.slow
def test_mixed_workload_of_the_pd_experiment(standin, tmp_path):
    import asyncio

    from loadtest.metrics import summarize_by_tag
    from loadtest.pd_vs_colocated import ExperimentConfig, mixed_load, table
    from loadtest.workload import load_tokenizer

    cfg = ExperimentConfig(out_dir=str(tmp_path), duration_s=1.0, decode_concurrency=2, decode_input_len=8,
                           decode_output_len=6, long_rate=5.0, long_input_len=300, long_output_len=2)
    results = asyncio.run(mixed_load(standin, cfg, load_tokenizer(None)))
    by = summarize_by_tag(results)
    assert by["decode"]["completed"] >= 4 and by["long"]["completed"] >= 1
    assert by["all"]["failed"] == 0
    assert {r.prompt_len for r in results if r.tag == "long"} == {300}
    assert max(r.start for r in results) < 1.3  # both streams stop issuing at the duration
    md = table({"pd": by, "colocated": by})
    assert md.count("\n| pd |") == 1 and "| colocated |" in md
    with pytest.raises(ValueError, match="modes"):
        ExperimentConfig(out_dir="x", modes=("pd", "bogus"))


@pytest.mark.slow
def test_multi_turn_chat_appends_each_reply(standin, tmp_path):
    """Issue 14 part 5: turn k's prompt is the system prompt, k+1 user messages and k replies (the
    stand-in counts prompt words: one token each), reported per turn index."""
    rc = main(["--url", standin, "--endpoint", "chat", "--conversations", "3", "--turns", "3", "--turn-len", "10",
               "--system-prompt-len", "5", "--output-len", "4", "--out", str(tmp_path), "--no-progress"])
    assert rc == 0
    doc = read(tmp_path)
    rows = doc["summary"]["by_turn"]
    assert [r["turn"] for r in rows] == [1, 2, 3] and all(r["requests"] == 3 and r["failed"] == 0 for r in rows)
    assert [r["prompt_tokens_mean"] for r in rows] == [5 + 10 * (k + 1) + 4 * k for k in range(3)]
    assert all(r["ttft_p50_s"] > 0 and r["cached_tokens_mean"] is None for r in rows)  # the stand-in caches nothing
    assert sorted({r["tag"] for r in doc["requests"]}) == ["turn0", "turn1", "turn2"]
