"""Issue 53, part 1, through a real colocated service (a tiny random model, a 256-token KV pool):
a prompt the pool can never hold is a 400 naming the sizes, at once; one whose prompt plus
max_new_tokens outgrows the whole pool streams and ends at the pool's end (finish reason length,
/generate saying why), within seconds, never a stall; /metrics counts it. The PD decode's side of the
same rule: tests/engine/test_overload.py and tests/integration/test_decode_queue.py."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import pytest
from pd_harness import call, start_service

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

POOL = 256
PROMPT = [(37 * i) % 250 + 1 for i in range(200)]


@pytest.fixture(scope="module")
def colo(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("overload") / "tiny"),
                            max_position_embeddings=2048)
    proc, _ = start_service("colocated", "--model", str(model), "--max-total-tokens", str(POOL),
                            "--page-size", "4")
    try:
        proc.wait_healthy(180)
        yield proc.url
    finally:
        proc.stop(5.0)


def _sampling(n: int) -> dict:
    return {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}


def test_prompt_larger_than_the_pool_is_a_400_at_once(colo: str) -> None:
    t0 = time.monotonic()
    status, body = call(colo, "/generate", {"input_ids": PROMPT * 2, "sampling_params": _sampling(8)}, timeout=30)
    assert status == 400, body
    msg = body["error"]["message"]  # type: ignore[index]
    assert "400 tokens" in msg and f"holds {POOL}" in msg, msg
    assert time.monotonic() - t0 < 10


def test_prompt_plus_max_tokens_past_the_pool_ends_at_its_end(colo: str) -> None:
    """200 + 100 > 256: the request gets every token the pool holds, finish reason length, the reason
    in /generate's meta_info; streamed the same; counted in pdserve_worker_pool_truncated_total."""
    status, body = call(colo, "/generate", {"input_ids": PROMPT, "sampling_params": _sampling(100)}, timeout=60)
    assert status == 200, body
    fin = body["meta_info"]["finish_reason"]  # type: ignore[index]
    assert fin["type"] == "length" and fin["length"] == POOL - len(PROMPT) + 1, fin
    assert "KV pool is full" in fin["message"], fin
    status, events = call(colo, "/generate", {"input_ids": PROMPT, "sampling_params": _sampling(100),
                                              "stream": True}, timeout=60)
    assert status == 200 and events[-1]["meta_info"]["finish_reason"]["type"] == "length", events[-1:]  # type: ignore[index]
    metrics = httpx.get(colo + "/metrics", timeout=10).text
    assert "pdserve_worker_pool_truncated_total 2.0" in metrics, [ln for ln in metrics.splitlines() if "trunc" in ln]
    assert "pdserve_worker_watchdog_ended_total 0.0" in metrics
