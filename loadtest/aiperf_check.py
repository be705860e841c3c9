"""Cross-check `pdserve bench` against NVIDIA aiperf on one configuration of a running router.

    python -m loadtest.aiperf_check --url http://127.0.0.1:8000 --out out/aiperf-check \\
        [--aiperf /opt/aiperf-venv/bin/aiperf] [--tokenizer DIR]

aiperf is heavy (pandas, dash, optuna, pinned pyzmq/pillow): install it in its own venv
(`python -m venv /opt/aiperf-venv && /opt/aiperf-venv/bin/pip install aiperf`) and pass --aiperf.
Both tools run the same shape, one after the other: completions endpoint, streaming, fixed
concurrency, synthetic prompts of --input-len tokens (aiperf gets the same local tokenizer folder),
--output-len tokens with ignore_eos. aiperf's "inter_token_latency" is per request
(e2e - ttft) / (tokens - 1), i.e. our TPOT; both our ITL and TPOT are printed beside it.
Writes OUT/aiperf_check.json, OUT/ours/ (bench JSON + PNGs) and OUT/aiperf/ (aiperf's artifacts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

from engine.models.embedded import resolve_model_path
from loadtest.cli import bench, build_parser
from loadtest.metrics import fmt_ms
from loadtest.report import write_json, write_plots

AIPERF_EXPORT = "profile_export_aiperf.json"


def aiperf_argv(binary: str, args: argparse.Namespace, model: str, tokenizer: str, out: Path) -> list[str]:
    return [binary, "profile", "--model", model, "--url", args.url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", tokenizer, "--concurrency", str(args.concurrency),
            "--request-count", str(args.num_requests), "--synthetic-input-tokens-mean", str(args.input_len),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_len),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--random-seed",
            str(args.seed), "--artifact-dir", str(out), "--ui-type", "none"]


def read_aiperf(out: Path) -> dict:
    """TTFT and ITL stats (seconds) from aiperf's JSON export under `out`."""
    found = sorted(out.rglob(AIPERF_EXPORT))
    if not found:
        raise RuntimeError(f"aiperf wrote no {AIPERF_EXPORT} under {out}")
    doc = json.loads(found[0].read_text())
    metrics = doc.get("metrics", doc) if isinstance(doc.get("metrics"), dict) else doc
    res = {}
    for tag in ("time_to_first_token", "inter_token_latency", "request_latency"):
        m = metrics.get(tag)
        if not isinstance(m, dict):
            continue
        scale = {"ms": 1e-3, "us": 1e-6, "ns": 1e-9, "s": 1.0}.get(str(m.get("unit", "ms")), 1e-3)
        stats = ("avg", "p50", "p90", "p99")
        res[tag] = {k: m[k] * scale for k in stats if isinstance(m.get(k), (int, float))}
    return res


def comparison(ours: dict, theirs: dict) -> str:
    rows = [("TTFT", ours["ttft_s"], theirs.get("time_to_first_token", {})),
            ("ITL (ours) vs aiperf ITL", ours["itl_s"], theirs.get("inter_token_latency", {})),
            ("TPOT (ours) vs aiperf ITL", ours["tpot_s"], theirs.get("inter_token_latency", {})),
            ("e2e", ours["e2e_s"], theirs.get("request_latency", {}))]
    lines = ["| metric | ours p50 | aiperf p50 | ours p99 | aiperf p99 |", "|---|---|---|---|---|"]
    for name, o, t in rows:
        lines.append(f"| {name} | {fmt_ms(o['p50'])} | {fmt_ms(t.get('p50'))} | {fmt_ms(o['p99'])} "
                     f"| {fmt_ms(t.get('p99'))} |")
    return "\n".join(lines) + "\n\n(ms)\n"


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    p.prog = "python -m loadtest.aiperf_check"
    p.description = __doc__
    p.add_argument("--aiperf", default="aiperf", help="the aiperf executable (its own venv)")
    p.set_defaults(concurrency=4, num_requests=32, input_len=128, output_len=32, no_progress=True)
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out is required")
    binary = shutil.which(args.aiperf)
    if binary is None:
        print(f"aiperf_check: {args.aiperf!r} not found; install aiperf in its own venv (see --help)",
              file=sys.stderr)
        return 2
    if args.tokenizer is None:
        args.tokenizer = str(resolve_model_path(""))
    out = Path(args.out)
    doc = asyncio.run(bench(args))
    write_json(out / "ours" / "bench.json", doc["config"], doc["summary"], doc["results"])
    write_plots(out / "ours", {"pdserve bench": doc["results"]})
    model = doc["config"]["client"]["model"]
    cmd = aiperf_argv(binary, args, model, args.tokenizer, out / "aiperf")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    (out / "aiperf.log").write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        print(f"aiperf failed ({res.returncode}); see {out}/aiperf.log", file=sys.stderr)
        return 1
    theirs = read_aiperf(out / "aiperf")
    text = comparison(doc["summary"], theirs)
    (out / "aiperf_check.json").write_text(json.dumps(
        {"command": cmd, "ours": doc["summary"], "aiperf": theirs, "table": text}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
