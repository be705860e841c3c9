"""Prometheus exposition (common/metrics.py, service/metrics.py) and response building (service/responses.py)."""

from __future__ import annotations

import json

from common.metrics import CollectorRegistry, Histogram, render, snapshot
from service.messages import TokenOut
from service.metrics import FrontendMetrics, render_worker_info
from service.protocol import Limits, parse_chat, parse_generate
from service.responses import RequestTracker, final_body, stream_chunks


def test_histogram_is_cumulative() -> None:
    reg = CollectorRegistry()
    h = Histogram("x_seconds", "help", buckets=(0.1, 1.0), registry=reg)
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    lines = render(reg).splitlines()
    assert 'x_seconds_bucket{le="0.1"} 2.0' in lines
    assert 'x_seconds_bucket{le="1.0"} 3.0' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4.0' in lines
    assert "x_seconds_count 4.0" in lines and "x_seconds_sum 3.65" in lines
    assert not any("_created" in ln for ln in lines)
    # the same counts as plain data, as a worker ships them, render the same buckets
    assert snapshot(h) == {"le": [0.1, 1.0], "counts": [2, 3], "sum": 3.65, "count": 4}
    shipped = render_worker_info({"histograms": {"x_seconds": snapshot(h)}}, prefix="")
    assert 'x_seconds_bucket{le="1.0"} 3.0' in shipped and 'x_seconds_bucket{le="+Inf"} 4.0' in shipped


def test_frontend_metrics_render() -> None:
    m = FrontendMetrics()
    m.requests.inc(endpoint="chat", status="200")
    m.requests.inc(endpoint="chat", status="200")
    text = m.render(running=3, worker_up=True, draining=False)
    assert 'pdserve_requests_total{endpoint="chat",status="200"} 2.0' in text
    assert "pdserve_running_requests 3.0" in text and "pdserve_worker_up 1.0" in text
    assert "# TYPE pdserve_time_to_first_token_seconds histogram" in text


def test_worker_info_rendered_generically() -> None:
    info = {"kv_used_tokens": 12, "ready": True, "model_path": "/m", "queues": {"waiting": 3, "running": 1},
            "counters": {"retractions": 2, "nested": {"a": 1}},
            "histograms": {"transfer_seconds": {"le": [0.1, 1.0], "counts": [1, 4], "sum": 2.5, "count": 5}}}
    lines = render_worker_info(info)
    assert "pdserve_worker_kv_used_tokens 12.0" in lines
    assert 'pdserve_worker_queues{name="waiting"} 3.0' in lines
    assert 'pdserve_worker_counters{name="retractions"} 2.0' in lines
    assert 'pdserve_worker_counters_nested{name="a"} 1.0' in lines
    assert 'pdserve_worker_transfer_seconds_bucket{le="1.0"} 4.0' in lines
    assert 'pdserve_worker_transfer_seconds_bucket{le="+Inf"} 5.0' in lines
    assert not any("model_path" in ln or "ready" in ln for ln in lines)  # strings and bools skipped


class CharTok:
    vocab_size = 1000
    path = "/tok"

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def id_to_token(self, i: int) -> str:
        return chr(i)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode(messages[-1]["content"])


LIM = Limits(role="colocated", context_length=100, vocab_size=1000, model_name="m")


def _out(rid: str, text: str, **kw) -> TokenOut:  # noqa: ANN003
    return TokenOut(rid=rid, new_token_ids=[ord(c) for c in text], **kw)


def test_native_response_with_stop_trim_and_logprobs() -> None:
    tok = CharTok()
    p = parse_generate({"text": "abc", "rid": "r", "return_logprob": True, "logprob_start_len": 0,
                        "sampling_params": {"stop": "XY"}}, tok, LIM)
    tr = RequestTracker(p, tok, 0.0)
    tr.consume(_out("r", "hi", new_logprobs=[-0.1, -0.2], input_start=0, input_logprobs=[-1.0, -2.0]))
    tr.consume(_out("r", "XY", new_logprobs=[-0.3, -0.4], finished=True, finish_reason="stop",
                    matched_stop="XY", prompt_tokens=3, completion_tokens=4))
    body = final_body(tr)
    assert body["text"] == "hi" and body["output_ids"] == [104, 105, 88, 89]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": "XY"}
    assert meta["completion_tokens"] == 4 and meta["prompt_tokens"] == 3
    assert meta["output_token_logprobs"][0] == [-0.1, 104, None]
    assert meta["input_token_logprobs"] == [[None, 97, None], [-1.0, 98, None], [-2.0, 99, None]]


def test_chat_stream_chunks() -> None:
    tok = CharTok()
    p = parse_chat({"messages": [{"role": "user", "content": "q"}], "stream": True,
                    "stream_options": {"include_usage": True}}, tok, LIM)
    tr = RequestTracker(p, tok, 0.0)
    events = stream_chunks(tr, tr.consume(_out(p.req.rid, "ab")), first=True)
    events += stream_chunks(tr, tr.consume(_out(p.req.rid, "c", finished=True, finish_reason="length",
                                                 prompt_tokens=1, completion_tokens=3)), first=False)
    objs = [json.loads(e[len(b"data: "):]) for e in events]
    assert objs[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(o["choices"][0]["delta"].get("content", "") for o in objs[1:3]) == "abc"
    assert objs[2]["choices"][0]["finish_reason"] == "length"
    assert objs[3]["choices"] == [] and objs[3]["usage"]["total_tokens"] == 4
    assert all(o["object"] == "chat.completion.chunk" for o in objs)
