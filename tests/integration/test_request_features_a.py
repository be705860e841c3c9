"""Issue 40 through real services (embedded model, CPU): priority with preemption, sessions, cache
salts (extra_key / cache_salt) and their 400s, on a colocated service and on a PD pair behind the
router (prefill + decode over UCX, every prompt disaggregated).

- priority: a full pool of long low-priority streams; an urgent request's first token comes before
  the queued low-priority ones' (a running one is preempted to the host pool and comes back), every
  request finishes, and every output equals the same burst sent without priorities.
- sessions: each turn sends only its new tokens and gets the tokens that resending the whole history
  gives, its history's KV reused; a closed session is refused; the PD router refuses sessions (400).
- extra_key: the same prompt under another salt reuses nothing (cached_tokens 0), under the same
  salt its cached pages (colocated; PD: the prefill's cache and the decode's own reuse).
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import start_service, wait_idle
from router_harness import Proc, free_port, start_router, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

# a 1920-token pool (120 pages of 16), every admitted request's future tokens reserved: two low-priority
# streams fit (59 pages each at their end), the other two and the urgent one (5 pages) queue for memory.
# The low streams are long (900 tokens) so that the two running ones are still running when the urgent
# request arrives, however fast the tiny model decodes on a quiet box.
COLO_FLAGS = ["--device", "cpu", "--threads", "1", "--max-total-tokens", "1920", "--new-token-ratio", "1.0",
              "--enable-priority-scheduling", "--session-timeout", "120", "--log-level", "warning"]
PROMPT = [(37 * i) % 250 + 1 for i in range(100)]  # token ids of the tiny model's vocabulary
LOW, HIGH = (40, 900), (64, 8)  # (prompt tokens, new tokens)


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory):
    """A colocated service (priority scheduling) and router -> prefill + decode, on a tiny random model
    (the embedded model's tokenizer) or, with PDSERVE_FEATURES_EMBEDDED=1, the embedded model (the
    TTFT figures in docs/benchmarks.md)."""
    model = [] if os.environ.get("PDSERVE_FEATURES_EMBEDDED") else \
        ["--model", str(make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("features") / "tiny"),
                                         max_position_embeddings=1024))]
    port = free_port()
    colo = Proc("colocated", [sys.executable, "-m", "pdserve", "colocated", "--port", str(port), *COLO_FLAGS,
                              *model], f"http://127.0.0.1:{port}")
    prefill, boot = start_service("prefill", "--enable-priority-scheduling", *model)
    decode, _ = start_service("decode", *model)
    router = None
    try:
        for p in (colo, prefill, decode):
            p.wait_healthy(300)
        router = start_router(["--prefill", f"{prefill.url},bootstrap_port={boot}", "--decode", decode.url])
        router.wait_healthy(60)
        yield {"colo": colo.url, "router": router.url, "decode": decode}
    finally:
        stops = [threading.Thread(target=p.stop, args=(5.0,)) for p in (router, colo, prefill, decode) if p is not None]
        for t in stops:  # at once: each may take its grace period
            t.start()
        for t in stops:
            t.join()


def _generate(url: str, body: dict) -> dict:
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(url: str, body: dict, out: dict) -> None:
    """One streamed /generate: out gets its TTFT, its output ids and its finish."""
    t0 = time.monotonic()
    buf = b""
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_bytes():  # events split on blank lines only (random text may hold U+2028)
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if not ev.startswith(b"data: {"):
                    continue
                event = json.loads(ev[6:])
                out.setdefault("first_at", time.monotonic())
                out.setdefault("ttft", out["first_at"] - t0)
                out["ids"] = event["output_ids"]
                out["finish"] = event["meta_info"]["finish_reason"]


def _burst(url: str, with_priority: bool) -> dict[str, dict]:
    """4 long low-priority streams (2 fill the pool, 2 queue), then, once 2 stream, an urgent one."""
    res: dict[str, dict] = {f"low{i}": {} for i in range(4)} | {"high": {}}
    long = {"max_new_tokens": LOW[1], "temperature": 0, "ignore_eos": True}
    threads = []
    for i in range(4):
        body = {"input_ids": PROMPT[i : i + LOW[0]], "sampling_params": long}
        if with_priority:
            body["priority"] = 0
        threads.append(threading.Thread(target=_stream, args=(url, body, res[f"low{i}"])))
        threads[-1].start()
    wait_for(lambda: sum("ttft" in res[f"low{i}"] for i in range(4)) >= 2, 120, "2 low streams")
    # the other 2 reached the server and wait for memory: the urgent one arrives after them (a busy box may
    # run their client threads late, and FCFS would then rightly serve the urgent one first)
    wait_for(lambda: _waiting(url) >= 2, 120, "2 low requests queued")
    high = {"input_ids": PROMPT[-HIGH[0]:], "sampling_params": {**long, "max_new_tokens": HIGH[1]}}
    if with_priority:
        high["priority"] = 10
    threads.append(threading.Thread(target=_stream, args=(url, high, res["high"])))
    threads[-1].start()
    for t in threads:
        t.join(300)
    return res


def _waiting(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r'^pdserve_worker_queues\{name="waiting"\} (\S+)', text, re.M)
    return int(float(found.group(1))) if found else 0


def _retractions(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r"^pdserve_worker_retractions_total (\S+)", text, re.M)
    return int(float(found.group(1))) if found else 0


class _Url:
    """pd_harness.wait_idle takes a process; it only reads `.url` and `.name`."""

    def __init__(self, url: str) -> None:
        self.url, self.name = url, url


def test_priority_preempts_under_a_full_pool_with_outputs_unchanged(stacks):
    url = stacks["colo"]
    before = _retractions(url)
    urgent = _burst(url, with_priority=True)
    preempted = _retractions(url) - before
    wait_idle(_Url(url))  # every page and host copy freed (the preempted request's too)
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200  # the next burst computes it all again
    plain = _burst(url, with_priority=False)  # the same burst, no priorities: first come first served
    wait_idle(_Url(url))
    def queued(run: dict) -> list[dict]:  # the two low streams that waited for memory
        return sorted((run[f"low{i}"] for i in range(4)), key=lambda r: r["first_at"])[2:]

    print(f"\nTTFT (s) high={urgent['high']['ttft']:.3f} queued-low={[round(r['ttft'], 3) for r in queued(urgent)]}"
          f" | without priority: high={plain['high']['ttft']:.3f} "
          f"queued-low={[round(r['ttft'], 3) for r in queued(plain)]} | preemptions={preempted}")
    assert preempted >= 1
    assert urgent["high"]["first_at"] < min(r["first_at"] for r in queued(urgent))  # ahead of the queue
    assert plain["high"]["first_at"] > min(r["first_at"] for r in queued(plain))  # first come, first served
    for name in urgent:
        assert urgent[name]["finish"]["type"] == "length"  # every low-priority request finished
        assert urgent[name]["ids"] == plain[name]["ids"], name


def test_sessions_equal_resending_history_and_reuse_its_kv(stacks):
    url = stacks["colo"]
    sid = httpx.post(url + "/open_session", json={"capacity_of_str_len": 1000}, timeout=30).json()
    sp = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    turns = [PROMPT[:40], [11, 12, 13, 14, 15], [21, 22, 23]]
    history: list[int] = []
    for i, new in enumerate(turns):
        got = _generate(url, {"input_ids": new, "sampling_params": sp, "session_params": {"id": sid}})
        whole = _generate(url, {"input_ids": history + new, "sampling_params": sp})
        assert got["output_ids"] == whole["output_ids"], i
        if i:  # the history (but its last, partial page) came from the pinned KV
            assert got["meta_info"]["cached_tokens"] >= len(history) // 16 * 16 - 16 > 0
        history += new + got["output_ids"]
    cut = _generate(url, {"input_ids": [7], "sampling_params": sp, "session_params": {"id": sid, "offset": 40}})
    assert cut["output_ids"] == _generate(url, {"input_ids": PROMPT[:40] + [7], "sampling_params": sp})["output_ids"]
    assert httpx.post(url + "/close_session", json={"session_id": sid}, timeout=30).status_code == 200
    r = httpx.post(url + "/generate", json={"input_ids": [1], "session_params": {"id": sid}}, timeout=30)
    assert r.status_code == 400 and "'session_params.id'" in r.json()["error"]["message"]
    router = stacks["router"]
    for path, body in (("/open_session", {"capacity_of_str_len": 10}),
                       ("/generate", {"input_ids": [1], "session_params": {"id": sid}})):
        r = httpx.post(router + path, json=body, timeout=30)
        assert r.status_code == 400 and "session" in r.json()["error"]["message"], (path, r.text)


def _reused_on_decode(decode: Proc) -> float:
    text = httpx.get(decode.url + "/metrics", timeout=30).text
    found = re.search(r"^pdserve_worker_kv_pages_reused_on_decode_total (\S+)", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.parametrize("where", ["colo", "router"])
def test_cache_salt_partitions_the_prefix_cache(stacks, where):
    client = openai.OpenAI(base_url=stacks[where] + "/v1", api_key="none", max_retries=0, timeout=300)
    prompt = [(53 * i + 11 * len(where)) % 250 + 1 for i in range(80)]

    def complete(salt: str | None, key: str = "cache_salt") -> tuple[str, int]:
        extra = {} if salt is None else {key: salt}
        c = client.completions.create(model="m", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        return c.choices[0].text, c.usage.prompt_tokens_details.cached_tokens

    decode = stacks["decode"]
    text, first = complete("tenant-a")
    assert first == 0
    reused = _reused_on_decode(decode)
    same = complete("tenant-a", "extra_key")  # both names: one salt
    assert same[0] == text and same[1] >= 64
    if where == "router":  # the decode held the prompt's pages under this salt: not sent again
        assert _reused_on_decode(decode) > reused
    reused = _reused_on_decode(decode)
    assert complete("tenant-b") == (text, 0)
    assert complete(None) == (text, 0)  # unsalted requests never see salted pages, nor the reverse
    assert _reused_on_decode(decode) == reused  # and the decode reused none of the salted pages
    for body, field in (({"prompt": [1], "cache_salt": 5}, "'cache_salt'"),
                        ({"prompt": [1], "priority": "high"}, "'priority'"),
                        ({"prompt": [1], "routing_key": 7}, "'routing_key'")):
        r = httpx.post(stacks[where] + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and field in r.json()["error"]["message"], (body, r.text)
    ok = httpx.post(stacks[where] + "/generate", json={"input_ids": [5, 6, 7], "priority": 3, "routing_key": "u1",
                                                        "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert ok.status_code == 200, ok.text  # forwarded untouched through the router
