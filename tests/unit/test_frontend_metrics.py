"""Prometheus exposition (common/metrics.py, service/metrics.py) and response building (service/responses.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from common.metrics import CollectorRegistry, Histogram, render, snapshot
from service.messages import StatsOut, TokenOut, decode, encode
from service.metrics import WORKER_METRICS, FrontendMetrics, render_worker_stats
from service.protocol import Limits, parse_chat, parse_generate
from service.responses import RequestTracker, final_body, stream_chunks
from service.stats import (
    Counters,
    Histo,
    KVStats,
    LinkStats,
    PrefixCacheStats,
    TransferTotals,
    WorkerStats,
    internal_state,
)


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
    shipped = render_worker_stats(StatsOut(token=1, info={}, stats=WorkerStats(transfer=TransferTotals(
        seconds=Histo.of(h)))))
    assert 'pdserve_worker_transfer_seconds_bucket{le="1.0"} 3.0' in shipped
    assert 'pdserve_worker_transfer_seconds_bucket{le="+Inf"} 4.0' in shipped


def test_frontend_metrics_render() -> None:
    m = FrontendMetrics()
    m.requests.inc(endpoint="chat", status="200")
    m.requests.inc(endpoint="chat", status="200")
    text = m.render(running=3, worker_up=True, draining=False)
    assert 'pdserve_requests_total{endpoint="chat",status="200"} 2.0' in text
    assert "pdserve_running_requests 3.0" in text and "pdserve_worker_up 1.0" in text
    assert "# TYPE pdserve_time_to_first_token_seconds histogram" in text


def _decode_stats() -> WorkerStats:
    return WorkerStats(
        queues={"waiting": 3, "running": 1}, kv=KVStats(used_tokens=12, total_tokens=64, host_used_pages=0, usage=0.19),
        prefix=PrefixCacheStats(cached_tokens=4, hit_tokens=8), counters=Counters(retractions=2, reloads=1),
        running_requests=1, active_rooms=0, time=5.0,
        transfer=TransferTotals(bytes=100, rooms_succeeded=2, rooms_failed=1, reused_bytes=50,
                                seconds=Histo(le=[0.1, 1.0], counts=[1, 4], sum=2.5, count=5)),
        link=LinkStats(receivers=0, peers=1, background_passes=7, control_dropped={"undecodable": 1}))


def test_worker_stats_rendered_typed() -> None:
    out = StatsOut(token=1, info={"ready": True, "model_path": "/m", "max_total_tokens": 64}, stats=_decode_stats())
    lines = render_worker_stats(out)
    for line in ("pdserve_worker_kv_used_tokens 12.0", 'pdserve_worker_queues{name="waiting"} 3.0',
                 "pdserve_worker_kv_usage 0.19", "pdserve_worker_running_requests 1.0",
                 "pdserve_worker_max_total_tokens 64.0", "pdserve_worker_prefix_cached_tokens 4.0",
                 "# TYPE pdserve_worker_retractions_total counter", "pdserve_worker_retractions_total 2.0",
                 "pdserve_worker_prefix_hit_tokens_total 8.0", "pdserve_worker_transfer_bytes_total 100.0",
                 "pdserve_worker_transfer_bytes_reused_total 50.0",
                 'pdserve_worker_transfer_rooms_total{name="failed"} 1.0', 'pdserve_worker_transfer{name="peers"} 1.0',
                 'pdserve_worker_transfer_control_dropped_total{name="undecodable"} 1.0',
                 "pdserve_worker_transfer_background_passes_total 7.0",
                 'pdserve_worker_transfer_seconds_bucket{le="1.0"} 4.0',
                 'pdserve_worker_transfer_seconds_bucket{le="+Inf"} 5.0'):
        assert line in lines, line
    # a role's missing parts render nothing; strings and bools of the description are no metrics
    assert not any(ln.startswith(("pdserve_worker_queued_prompt_tokens", "pdserve_worker_forward_tokens",
                                  "pdserve_worker_counters", "pdserve_worker_transfer_prefix_refusals"))
                   for ln in lines)
    assert not any(ln.startswith(("pdserve_worker_model_path", "pdserve_worker_ready")) for ln in lines)
    # each metric has one declared type: every sample belongs to a family with a TYPE line
    types = {ln.split()[2]: ln.split()[3] for ln in lines if ln.startswith("# TYPE")}
    assert all(t == "counter" for n, t in types.items() if n.endswith("_total"))
    assert all(n.endswith("_total") for n, t in types.items() if t == "counter")
    assert len({m.name for m in WORKER_METRICS}) == len(WORKER_METRICS)


def test_stats_out_round_trip_and_server_info_shape() -> None:
    out = StatsOut(token=3, info={"role": "decode", "page_size": 16}, stats=_decode_stats())
    assert decode(encode(out)) == out
    st = internal_state(out.info, out.stats)
    assert st["role"] == "decode" and st["queues"] == {"waiting": 3, "running": 1}
    assert st["counters"] == {"retractions": 2, "reloads": 1}
    assert st["kv_used_tokens"] == 12 and st["kv_usage"] == 0.19 and st["host_kv_used_pages"] == 0
    assert st["transfer_rooms"] == {"succeeded": 2, "failed": 1} and st["transfer_bytes_reused_total"] == 50
    assert st["histograms"]["transfer_seconds"] == {"le": [0.1, 1.0], "counts": [1, 4], "sum": 2.5, "count": 5}
    assert st["transfer"]["control_dropped"] == {"undecodable": 1} and "senders" not in st["transfer"]
    assert st["prefix_hit_tokens"] == 8 and st["time"] == 5.0 and "queued_prompt_tokens" not in st


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


def test_dashboard_worker_queries_use_declared_metrics_by_type() -> None:
    """Every pdserve_worker_* series the Grafana dashboard reads is declared in WORKER_METRICS (or is
    the frontend's pdserve_worker_up), and rate() is only taken of counters and histogram buckets.
    (The slow integration test also checks the names against live services' /metrics.)"""
    dash = json.loads((Path(__file__).resolve().parents[2] / "deploy/grafana/pdserve-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    kinds = {m.name: m.kind for m in WORKER_METRICS} | {"pdserve_worker_up": "gauge"}
    kinds |= {m.name + "_bucket": "bucket" for m in WORKER_METRICS if m.kind == "histogram"}
    for e in exprs:
        for name in re.findall(r"\bpdserve_worker_[a-z0-9_]+", e):
            assert name in kinds, f"{name} in {e!r} is not a declared worker metric"
        for name in re.findall(r"\brate\((pdserve_worker_[a-z0-9_]+)", e):
            assert kinds[name] in ("counter", "bucket"), f"rate() of the {kinds[name]} {name} in {e!r}"
