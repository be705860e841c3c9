"""The split-node chaos suite's pure parts: its checks, its table and the doc rewrite (the suite itself
runs in tests/load/test_chaos_netns.py)."""

from __future__ import annotations

import pytest

from loadtest.chaosnet import (
    BEGIN,
    END,
    SCENARIOS,
    _problems,
    build_parser,
    main,
    retraction_counters,
    table,
    write_doc,
)

KILL = SCENARIOS[0]
OVER = next(s for s in SCENARIOS if s.fault == "oversubscribe")


def _row(**kw) -> dict:  # noqa: ANN003
    row = {"scenario": "kill-decode", "what": "kill -9 a decode mid-stream", "requests": 8, "completed": 8,
           "equal_to_unfailed": 8, "migrated": 3, "retried": 0, "clean_errors": 0, "hangs": 0, "pools_after": "0",
           "hit": {"node": "d1", "in_flight": 3}, "next_batch_ok": 8}
    return row | kw


def test_problems_name_each_broken_promise():
    assert _problems(_row(), KILL) == []
    got = _problems(_row(equal_to_unfailed=7, hangs=1, hit={}, next_batch_ok=6), KILL)
    assert len(got) == 4 and "1 of 8 requests did not end with the unfailed text" in got[0]
    assert "hung" in got[1] and "hit no request" in got[2] and "6 of 8" in got[3]
    over = _row(hit={"node": "d2", "in_flight": 8, "need_pages": 28, "pool_pages": 7, "retractions": 0,
                     "reloads": 0})
    assert "no retraction" in _problems(over, OVER)[0]


def test_table_and_doc_rewrite(tmp_path):
    report = {"rows": [_row()], "total_s": 300.4, "startup_s": 50.0, "reference_s": 12.0}
    text = table(report)
    assert "| kill -9 a decode mid-stream (3 requests on it) | 8 | 8 | 8 | 3 | 0 | 0 | 0 | 0 | 8/8 |" in text
    doc = tmp_path / "r.md"
    doc.write_text(f"intro\n{BEGIN}\nold\n{END}\nafter\n")
    write_doc(doc, report, "python -m loadtest.chaosnet --out x")
    out = doc.read_text()
    assert out.startswith("intro\n") and out.endswith(f"{END}\nafter\n") and "old" not in out
    assert text in out and "python -m loadtest.chaosnet --out x" in out and "load average" in out
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        write_doc(doc, report, "cmd")


def test_cli_rejects_unknown_scenarios(capsys):
    assert build_parser().parse_args(["--out", "x"]).scenarios[0] == "kill-decode"
    with pytest.raises(SystemExit):
        main(["--out", "x", "--scenarios", "kill-decode,nope"])
    assert "unknown scenarios ['nope']" in capsys.readouterr().err


def test_retraction_counters_read_either_metric_name():
    typed = "pdserve_worker_retractions_total 3\npdserve_worker_reloads_total 2\n"
    old = 'pdserve_worker_counters{name="retractions"} 4\npdserve_worker_counters{name="reloads"} 1\n'
    assert retraction_counters(typed) == {"retractions": 3, "reloads": 2}
    assert all(type(v) is int for v in retraction_counters(typed).values())  # the table prints them
    assert retraction_counters(old) == {"retractions": 4, "reloads": 1}
