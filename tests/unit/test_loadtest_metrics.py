"""Metrics math of the load generator on synthetic timings, Prometheus parsing, KV byte arithmetic."""

from __future__ import annotations

import json
import math

import pytest

from loadtest import promtext
from loadtest.metrics import SLO, RequestResult, distribution, summarize, summarize_by_tag
from loadtest.splitnode import expected_kv_bytes, kv_bytes_per_token


def req(i: int, start: float, chunks: list[float], out: int | None = None, error: str | None = None,
        tag: str = "") -> RequestResult:
    end = chunks[-1] if chunks else start + 1
    n = len(chunks) if out is None else out
    return RequestResult(index=i, prompt_len=10, output_len=n, start=start, chunk_times=chunks, end=end,
                         output_tokens=n, error=error, tag=tag)


def test_per_request_ttft_itl_tpot_e2e():
    r = req(0, 1.0, [1.5, 1.6, 1.8, 2.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)
    assert r.tpot == pytest.approx(0.6 / 3)
    assert req(1, 0.0, [0.2]).tpot is None  # one token: no TPOT
    assert not req(2, 0.0, [], error="HTTP 500: x").ok


def test_distribution_percentiles():
    d = distribution([float(x) for x in range(1, 101)])
    assert d["count"] == 100 and d["min"] == 1 and d["max"] == 100
    assert d["p50"] == pytest.approx(50.5)
    assert d["p99"] == pytest.approx(99.01)
    assert d["mean"] == pytest.approx(50.5)
    assert distribution([])["p50"] is None


def test_summary_throughput_and_goodput():
    results = [
        req(0, 0.0, [0.1, 0.2, 0.3]),  # ttft .1, tpot .1
        req(1, 0.0, [0.5, 0.6, 0.7]),  # ttft .5 (misses a .2 TTFT SLO)
        req(2, 1.0, [1.1, 1.5, 1.9]),  # tpot .4 (misses a .2 TPOT SLO)
        req(3, 1.0, [], error="HTTP 500: boom"),  # end = 2.0
    ]
    s = summarize(results, SLO(ttft_s=0.2, tpot_s=0.2))
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["errors"] == ["HTTP 500: boom"]
    assert s["duration_s"] == pytest.approx(2.0)
    assert s["output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_token_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx((9 + 30) / 2)
    assert s["good_requests"] == 1
    assert s["goodput"] == pytest.approx(0.5)
    assert s["goodput_fraction"] == pytest.approx(0.25)
    assert s["itl_s"]["count"] == 6
    assert s["ttft_s"]["max"] == pytest.approx(0.5)
    assert s["tpot_s"]["max"] == pytest.approx(0.4)
    # no SLO: every completed request is good
    assert summarize(results)["good_requests"] == 3
    json.dumps(s)  # serialisable


def test_short_outputs_and_tags():
    a = req(0, 0.0, [0.1, 0.2], tag="long")
    b = req(1, 0.0, [0.1, 0.2], tag="short")
    b.output_len = 5  # asked for 5, got 2
    by = summarize_by_tag([a, b])
    assert set(by) == {"all", "long", "short"}
    assert by["all"]["short_outputs"] == 1 and by["long"]["short_outputs"] == 0


def test_slo_validation():
    with pytest.raises(ValueError, match="slo-ttft"):
        SLO(ttft_s=0)
    with pytest.raises(ValueError, match="slo-tpot"):
        SLO(tpot_s=-1)


def test_promtext_parse_and_total():
    text = (
        "# HELP pdserve_worker_transfer_bytes_total KV bytes\n"
        "# TYPE pdserve_worker_transfer_bytes_total counter\n"
        'pdserve_worker_transfer_bytes_total{direction="send",peer="a"} 1.5e3\n'
        'pdserve_worker_transfer_bytes_total{direction="recv",peer="b"} 500\n'
        "pdserve_kv_used_tokens 0 1712345678\n"
    )
    s = promtext.parse(text)
    assert promtext.total(s, "pdserve_worker_transfer_bytes_total") == 2000
    assert promtext.total(s, "pdserve_worker_transfer_bytes_total", direction="recv") == 500
    assert math.isnan(promtext.total(s, "nope"))
    assert promtext.names_with_prefix(s, "pdserve_kv") == ["pdserve_kv_used_tokens"]
    with pytest.raises(ValueError, match="line 1"):
        promtext.parse("not a metric line at all")


def test_kv_bytes_per_token_and_pages(tmp_path):
    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    bpt = kv_bytes_per_token(tmp_path, "float32")
    assert bpt == 30 * 2 * 3 * 64 * 4 == 46080
    assert kv_bytes_per_token(tmp_path, "bfloat16") == bpt // 2
    assert expected_kv_bytes([1, 16, 17], 16, bpt) == (16 + 16 + 32) * bpt
