"""The combination matrix (issue 51; tests/matrix/matrix.py runs it): every tiny model family crossed with
every pair of features either serves the reference's tokens or is refused with a clear message. The run's
verdicts must be exactly what docs/combination_matrix.md and .json say: a cell that starts to fail, or a
refusal lifted, changes the doc, so the doc cannot go stale (regenerate it with
`.venv/bin/python scripts/combination_matrix.py`)."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from tests.matrix.matrix import FEATURES, Verdict, cell_name, cells, clean, startup_sets
from tests.matrix.render import to_json, to_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _diff(want: str, got: str, name: str) -> str:
    lines = difflib.unified_diff(want.splitlines(), got.splitlines(), f"committed {name}", "this run", lineterm="", n=1)
    return "\n".join(list(lines)[:60])


def test_cells_and_engines_cover_every_pair() -> None:
    names = {cell_name(c) for c in cells()}
    assert len(names) == len(FEATURES) + len(FEATURES) * (len(FEATURES) - 1) // 2
    assert "tp2+pd" in names and "grammar+logprobs" in names and "tp2" in names
    sets = startup_sets()
    assert frozenset() in sets and frozenset({"tp2", "pd"}) in sets
    assert frozenset({"ngram", "draft"}) not in sets  # one --speculative method per engine: n/a


def test_messages_lose_paths_and_ports() -> None:
    text = clean("bad /tmp/pytest-1/x/model at 127.0.0.1:40123 in /m/dir", "/m/dir")
    assert text == "bad <path> at 127.0.0.1:<port> in <model>"


def test_render_is_a_function_of_the_verdicts() -> None:
    verdicts = {"dense": {cell_name(c): Verdict("works") for c in cells()}}
    verdicts["dense"]["tp2+host"] = Verdict("refused", "start-up: --hicache-host-tokens is not supported")
    md = to_markdown(verdicts)
    assert "| **TP2** | ok | ok | ok | ok | ok | R 1 |" in md
    assert "1. refused: start-up: --hicache-host-tokens is not supported" in md
    assert to_markdown(verdicts) == md
    assert json.loads(to_json(verdicts))["models"]["dense"]["tp2+host"]["status"] == "refused"


@pytest.mark.slow
def test_matrix_matches_the_committed_doc(tmp_path: Path) -> None:
    from tests.matrix.matrix import run_matrix

    verdicts = run_matrix(tmp_path)
    failing = {k: {c: v.note for c, v in cells.items() if v.status == "fails"} for k, cells in verdicts.items()}
    md, js = to_markdown(verdicts), to_json(verdicts)
    for name, got in (("combination_matrix.md", md), ("combination_matrix.json", js)):
        want = (DOCS / name).read_text()
        assert got == want, f"docs/{name} is stale (scripts/combination_matrix.py rewrites it; cells that fail: " \
                            f"{failing}):\n{_diff(want, got, name)}"
