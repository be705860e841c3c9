"""KV cache events from a real colocated service (issue 52, docs/kv_events.md), on the tiny random-weight
model with the embedded tokenizer.

Checked: /server_info names the PUB and replay endpoints; a SUB subscribed before a request hears
BlockStored for the prompt's full pages (the hashes a router computes with `block_hashes`), then
AllBlocksCleared after /flush_cache; a SUB that connects afterwards catches up through the replay socket
(the same sequence numbers and payloads); the drop counter reaches /metrics.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from pd_harness import call, info, start_service

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.kvcache.events import block_hashes  # noqa: E402
from tests.kv_events_client import replay  # noqa: E402
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

PAGE = 8


@pytest.fixture(scope="module")
def colo(tmp_path_factory: pytest.TempPathFactory):
    model = make_tiny_model(make_tokenizer_dir(tmp_path_factory.mktemp("kv_events") / "model"))
    proc, _ = start_service("colocated", "--model", str(model), "--page-size", str(PAGE), "--kv-events-endpoint",
                            "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*",
                            "--kv-events-topic", "kv")
    try:
        proc.wait_healthy(300)
        yield proc
    finally:
        proc.stop()


def _events(payload: bytes) -> list[list]:
    """A KVEventBatch [ts, events, dp_rank] of array-encoded events ([tag, fields...])."""
    ts, events, *_ = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    return events


def _recv_until(sub: zmq.Socket, tag: str, timeout: float = 20.0) -> list[tuple[int, bytes]]:
    """(seq, payload) of every message until one holds an event tagged `tag`."""
    got, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sub.poll(200):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        got.append((int.from_bytes(seq, "big"), payload))
        if any(e[0] == tag for e in _events(payload)):
            return got
    raise AssertionError(f"no {tag} within {timeout} s: {[_events(p) for _, p in got]}")


def test_events_stream_then_replay(colo) -> None:  # noqa: ANN001
    where = info(colo)["kv_events"]
    assert where["topic"] == "kv" and where["encoding"] == "array" and where["block_size"] == PAGE
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.linger = 0
    sub.connect(where["endpoint"])
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    try:
        time.sleep(0.5)  # the SUB's subscription reaches the PUB (zmq's slow joiner)
        prompt = [(7 * i) % 200 + 5 for i in range(30)]
        status, body = call(colo.url, "/generate", {"input_ids": prompt, "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})
        assert status == 200, body
        live = _recv_until(sub, "BlockStored")
        stored = [e for _, p in live for e in _events(p) if e[0] == "BlockStored"]
        hashes = [h for e in stored for h in e[1]]
        assert hashes[:3] == block_hashes(prompt, PAGE)  # the prompt's 3 full pages, as a router computes them
        first = stored[0]
        assert first[2] is None and first[3][:24] == prompt[:24] and first[4] == PAGE and first[6] == "GPU"
        assert httpx.post(colo.url + "/flush_cache", timeout=30).status_code == 200
        live += _recv_until(sub, "AllBlocksCleared")
    finally:
        sub.close()
    seqs = [s for s, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gap
    caught_up = replay(where["replay_endpoint"], 0)  # a subscriber that joins late
    assert [x for x in caught_up if x[0] >= seqs[0]] == live
    assert any(e[0] == "AllBlocksCleared" for _, p in caught_up for e in _events(p))
    metrics = httpx.get(colo.url + "/metrics", timeout=10).text
    assert "pdserve_worker_kv_events_dropped_total" in metrics
