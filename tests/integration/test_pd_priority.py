"""Priority preempts on a PD decode, through the router (issue 47): real processes, router -> prefill +
decode, both with --enable-priority-scheduling, on a tiny random model.

The decode's pool (65 pages of 16 tokens, every admitted request's future tokens reserved) holds one
long low-priority stream whole (1032 tokens: long enough that the urgent request's trip through the
router and the prefill always ends before it does, on a busy box too): beside it, the free pages less
its reservation never cover an urgent prompt. The urgent request arrives from the prefill while the
low one streams; the decode retracts the low one to its host pool (a preemption: its KV is kept,
never recomputed), admits the urgent one, which finishes first, and reloads the low one, which
finishes with exactly the tokens it gets when run alone (greedy). Every wait is on a condition
(stream events, /metrics, /server_info), never a sleep.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from pd_harness import start_service, wait_idle
from router_harness import Proc, start_router, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

PRIO = ["--enable-priority-scheduling"]
# 1040 tokens = 65 pages: the low stream's 32 + 1000 tokens take 65; its pages plus its reservation
# leave no page beside it, the urgent prompt needs 4 (+1 reserved)
DECODE = [*PRIO, "--max-total-tokens", "1040", "--new-token-ratio", "1.0"]
LOW = {"input_ids": [(37 * i) % 250 + 1 for i in range(32)], "priority": 0,
       "sampling_params": {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}}
HIGH = {"input_ids": [(53 * i + 7) % 250 + 1 for i in range(64)], "priority": 10,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory):
    tiny = make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("prio") / "tiny"), max_position_embeddings=2048)
    model = ["--model", str(tiny)]
    prefill, boot = start_service("prefill", *PRIO, *model)
    decode, _ = start_service("decode", *DECODE, *model)
    router = None
    try:
        for p in (prefill, decode):
            p.wait_healthy(300)
        router = start_router(["--prefill", f"{prefill.url},bootstrap_port={boot}", "--decode", decode.url])
        router.wait_healthy(60)
        yield {"router": router.url, "decode": decode}
    finally:
        stops = [threading.Thread(target=p.stop, args=(5.0,)) for p in (router, prefill, decode) if p is not None]
        for t in stops:  # at once: each may take its grace period
            t.start()
        for t in stops:
            t.join()


def _stream(url: str, body: dict, out: dict) -> None:
    """One streamed /generate through the router: out gets its first token, output ids and finish."""
    buf = b""
    with httpx.stream("POST", url + "/generate", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for chunk in r.iter_bytes():  # events split on blank lines only (random text may hold U+2028)
            buf += chunk
            *events, buf = buf.split(b"\n\n")
            for ev in events:
                if ev.startswith(b"data: {"):
                    event = json.loads(ev[6:])
                    out.setdefault("first_at", time.monotonic())
                    out["ids"] = event["output_ids"]
                    out["finish"] = event["meta_info"]["finish_reason"]
    out["done_at"] = time.monotonic()


def _retractions(decode: Proc) -> int:
    text = httpx.get(decode.url + "/metrics", timeout=30).text
    found = re.search(r"^pdserve_worker_retractions_total (\S+)", text, re.M)
    return int(float(found.group(1))) if found else 0


def _alone(url: str, body: dict) -> list[int]:
    r = httpx.post(url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_urgent_request_from_the_prefill_preempts_a_running_one_on_the_decode(pd):
    url, decode = pd["router"], pd["decode"]
    before = _retractions(decode)
    low: dict = {}
    high: dict = {}
    t0 = time.monotonic()
    threads = [threading.Thread(target=_stream, args=(url, LOW, low))]
    threads[0].start()
    wait_for(lambda: len(low.get("ids", [])) >= 1, 120, "the low stream's first token")  # it runs on the decode
    threads.append(threading.Thread(target=_stream, args=(url, HIGH, high)))
    threads[1].start()
    for t in threads:
        t.join(300)
    assert low.get("finish", {}).get("type") == "length" and high.get("finish", {}).get("type") == "length"
    preempted = _retractions(decode) - before
    wait_idle(decode)  # every page and host copy freed (the preempted request's too)
    print(f"\nburst {time.monotonic() - t0:.2f}s: high first {high['first_at'] - t0:.2f}s, "
          f"done {high['done_at'] - t0:.2f}s; low done {low['done_at'] - t0:.2f}s; decode retractions {preempted}")
    assert preempted >= 1  # the running low-priority stream made room for the urgent one
    assert high["done_at"] < low["done_at"]  # admitted at once, not once the low stream finished
    assert len(low["ids"]) == 1000 and low["ids"] == _alone(url, LOW)  # finished unchanged
    assert high["ids"] == _alone(url, HIGH)
