"""aiperf cross-check plumbing: the command line it builds and the parsing of aiperf's JSON export."""

from __future__ import annotations

import json

import pytest

from loadtest.aiperf_check import aiperf_argv, comparison, main, read_aiperf
from loadtest.cli import build_parser
from loadtest.metrics import distribution


def test_argv_carries_the_same_shape(tmp_path):
    args = build_parser().parse_args(["--url", "http://192.0.2.1:8000", "--concurrency", "3",
                                      "--num-requests", "9", "--input-len", "64", "--output-len", "8"])
    argv = aiperf_argv("aiperf", args, "m", "/tok", tmp_path)
    flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1])}
    assert argv[:2] == ["aiperf", "profile"]
    assert flags["--url"] == "http://192.0.2.1:8000" and flags["--tokenizer"] == "/tok"
    assert flags["--concurrency"] == "3" and flags["--request-count"] == "9"
    assert flags["--synthetic-input-tokens-mean"] == "64" and flags["--output-tokens-mean"] == "8"
    assert flags["--extra-inputs"] == "ignore_eos:true" and "--streaming" in argv


def test_read_export_and_compare(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile_export_aiperf.json").write_text(json.dumps({
        "time_to_first_token": {"unit": "ms", "avg": 120.0, "p50": 100.0, "p99": 300.0},
        "inter_token_latency": {"unit": "ms", "avg": 20.0, "p50": 19.0, "p99": 40.0},
        "request_throughput": {"unit": "requests/sec", "avg": 3.0},
    }))
    got = read_aiperf(tmp_path)
    assert got["time_to_first_token"]["p50"] == pytest.approx(0.1)
    assert got["inter_token_latency"]["p99"] == pytest.approx(0.04)
    ours = {k: distribution([0.1, 0.2]) for k in ("ttft_s", "itl_s", "tpot_s", "e2e_s")}
    table = comparison(ours, got)
    assert "| TTFT | 150.0 | 100.0 |" in table and "| e2e | 150.0 | - |" in table
    with pytest.raises(RuntimeError, match="profile_export"):
        read_aiperf(tmp_path / "run" / "nothing")


def test_missing_binary_is_a_clear_error(tmp_path, capsys):
    assert main(["--url", "http://127.0.0.1:9", "--out", str(tmp_path), "--aiperf", "no-such-aiperf"]) == 2
    assert "not found" in capsys.readouterr().err
