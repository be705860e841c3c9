"""Run the combination matrix (issue 51: every tiny model family x every pair of features) and write
docs/combination_matrix.md and docs/combination_matrix.json from the result.

    .venv/bin/python scripts/combination_matrix.py            # write both files
    .venv/bin/python scripts/combination_matrix.py --check    # exit 1 when the committed files differ
    .venv/bin/python scripts/combination_matrix.py --models dense mla --out /tmp/m   # part of it, elsewhere

The suite runs the same matrix (tests/matrix/test_combination_matrix.py) and fails when the committed files
are not what the code gives, so the doc cannot go stale. CPU only, about the suite's time for it.
"""

from __future__ import annotations

import os

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as tests/conftest.py: before torch is imported

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.matrix.families import KINDS  # noqa: E402
from tests.matrix.matrix import run_matrix  # noqa: E402
from tests.matrix.render import to_json, to_markdown  # noqa: E402

DOC, JSON = ROOT / "docs" / "combination_matrix.md", ROOT / "docs" / "combination_matrix.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=KINDS, default=list(KINDS),
                    help="model families to run (default: all; a partial run never writes docs/)")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory to write combination_matrix.md/.json into (default: docs/ for a full run)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when docs/ differs from the run")
    ap.add_argument("--quiet", action="store_true", help="no per-engine progress lines on stderr")
    args = ap.parse_args(argv)
    partial = tuple(args.models) != KINDS
    if partial and (args.out is None or args.check):
        ap.error("--models with a subset needs --out, and no --check (docs/ holds the whole matrix)")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="pdserve-matrix-") as tmp:
        log = None if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
        verdicts = run_matrix(Path(tmp), tuple(args.models), log)
    md, js = to_markdown(verdicts), to_json(verdicts)
    print(f"matrix: {sum(len(v) for v in verdicts.values())} cells in {time.monotonic() - t0:.0f} s", file=sys.stderr)
    if args.check:
        stale = [p for p, text in ((DOC, md), (JSON, js)) if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"{p.relative_to(ROOT)} is stale: run scripts/combination_matrix.py", file=sys.stderr)
        return 1 if stale else 0
    out = args.out or DOC.parent
    out.mkdir(parents=True, exist_ok=True)
    (out / DOC.name).write_text(md)
    (out / JSON.name).write_text(js)
    print(f"wrote {out / DOC.name} and {out / JSON.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
