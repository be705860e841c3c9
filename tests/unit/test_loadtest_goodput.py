"""The goodput sweep's arithmetic and report (the services part is benchmarks/goodput.py's run)."""

from __future__ import annotations

import pytest

from loadtest.goodput import GoodputConfig, max_rate, plot, table


def _row(rate: float, good: int, n: int) -> dict:
    dist = {"p50": 0.5, "p90": 0.9}
    return {"rate": rate, "requests": n, "failed": 0, "good": good, "goodput": good / 10,
            "attainment": good / n, "ttft_s": dist, "tpot_s": dist}


def test_max_rate_is_the_highest_rate_that_meets_the_attainment():
    rows = [_row(0.5, 5, 5), _row(1.0, 9, 10), _row(1.5, 8, 15), _row(2.0, 19, 20)]
    assert max_rate(rows, 0.9) == 2.0  # not monotone: the highest sustained one counts
    assert max_rate(rows[:3], 0.9) == 1.0
    assert max_rate(rows, 1.0) == 0.5
    assert max_rate([_row(1.0, 0, 10)], 0.9) == 0.0


def test_table_and_plot(tmp_path):
    cfg = GoodputConfig(out_dir=str(tmp_path), rates=(0.5, 1.0), modes=("pd", "colocated"))
    by_mode = {"pd": [_row(0.5, 5, 5), _row(1.0, 9, 10)], "colocated": [_row(0.5, 4, 5), _row(1.0, 3, 10)]}
    text = table(cfg, by_mode)
    assert "| pd | 1 | 9/10 | 0.90 | 90% |" in text
    assert "pd 1 req/s, colocated 0 req/s" in text and "TTFT <= 2000 ms and TPOT <= 250 ms" in text
    png = plot(tmp_path / "g.png", cfg, by_mode)
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("bad", [{"rates": ()}, {"rates": (0.0,)}, {"attainment": 0.0}, {"output_len": 1},
                                 {"modes": ("pd", "nope")}])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        GoodputConfig(out_dir="x", **bad)
