"""A worker's overload refusal on the HTTP side (issue 53): service/frontend.py answers a request whose
tracker failed with `retry_after` > 0 with that `retry_after` in the error object and, unary, a
`Retry-After` header; a stream (HTTP 200 by then) carries it in its error event only.

The frontend runs in-process (Starlette's TestClient) over a bridge double that answers every request
with one TokenOut, so no worker, model or zmq is involved.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.testclient import TestClient

from service.config import ServerConfig
from service.frontend import FrontendState, create_app
from service.messages import TokenOut

BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 4}}


class CharTok:
    """One token per character (tests/unit/test_frontend_metrics.py's tokenizer, plus what the app reads)."""

    vocab_size = 1000
    path = "/tok"  # no tokenizer_config.json there: no grammar warm-up starts
    eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def id_to_token(self, i: int) -> str:
        return chr(i)


class Bridge:
    """service.bridge.WorkerBridge's surface the generation path uses; every request gets `answer`."""

    info = {"context_length": 100, "vocab_size": 1000}
    alive, dead_reason = True, ""

    def __init__(self, answer: dict) -> None:
        self.answer = answer
        self.ready = asyncio.Event()
        self.ready.set()
        self.queues: dict[str, asyncio.Queue] = {}

    def open(self, rid: str) -> asyncio.Queue:
        self.queues[rid] = asyncio.Queue()
        return self.queues[rid]

    async def send(self, req) -> None:  # noqa: ANN001
        self.queues[req.rid].put_nowait(TokenOut(rid=req.rid, new_token_ids=[], finished=True, **self.answer))

    def send_soon(self, msg) -> None:  # noqa: ANN001
        pass

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)


def _client(answer: dict) -> TestClient:
    state = FrontendState(config=ServerConfig(), bridge=Bridge(answer), tokenizer=CharTok(), model_dir="")
    return TestClient(create_app(state))


OVERLOAD = {"finish_reason": "error", "error": "decode queue full (64 waiting)", "error_code": 503, "retry_after": 4}


def test_overload_refusal_has_retry_after_header_and_body() -> None:
    r = _client(OVERLOAD).post("/generate", json=BODY)
    assert r.status_code == 503 and r.headers["retry-after"] == "4"
    assert r.json()["error"] == {"message": "decode queue full (64 waiting)", "type": "server_error",
                                 "code": 503, "retry_after": 4}


def test_overload_refusal_in_a_stream_is_in_the_error_event() -> None:
    with _client(OVERLOAD).stream("POST", "/generate", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and "retry-after" not in r.headers
        events = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert json.loads(events[0])["error"]["retry_after"] == 4 and events[-1] == "[DONE]"


@pytest.mark.parametrize("answer", [
    {"finish_reason": "error", "error": "KV transfer failed", "error_code": 503, "fault": "prefill"},
    {"finish_reason": "error", "error": "boom", "error_code": 500},
])
def test_other_errors_have_no_retry_after(answer: dict) -> None:
    r = _client(answer).post("/generate", json=BODY)
    assert r.status_code == answer["error_code"] and "retry-after" not in r.headers
    assert "retry_after" not in r.json()["error"] and r.json()["error"]["message"] == answer["error"]
