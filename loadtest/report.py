"""Bench output: one JSON file (config, summary, per-request timings) and PNG plots.

Plots (matplotlib, Agg backend, no display needed):
    latency_cdf.png   CDFs of TTFT, ITL, TPOT and e2e latency, one line per series
    itl_over_time.png each ITL sample at its arrival time (stalls show up as spikes)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from loadtest.metrics import RequestResult, fmt_ms


def write_json(path: Path, config: dict, summary: dict, results: list[RequestResult]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "summary": summary, "requests": [r.to_json() for r in results]}
    path.write_text(json.dumps(doc, indent=1))
    return path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {
        "TTFT": [r.ttft for r in ok],
        "ITL": [x for r in ok for x in r.itls],
        "TPOT": [t for r in ok if (t := r.tpot) is not None],
        "e2e": [r.e2e for r in ok],
    }


def plot_cdfs(path: Path, runs: dict[str, list[RequestResult]], title: str = "") -> Path:
    """One panel per metric; one line per run label (e.g. "pd" and "colocated")."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    plotted = [False] * 4
    for label, results in runs.items():
        for i, (ax, vals) in enumerate(zip(axes, _series(results).values())):
            if not vals:
                continue
            xs = sorted(max(v * 1000, 1e-3) for v in vals)  # ms, floored for the log axes
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            ax.step(xs, ys, where="post", label=label)
            plotted[i] = True
    for ax, name, has_data in zip(axes, ("TTFT", "ITL", "TPOT", "e2e"), plotted):
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if name in ("ITL", "TTFT") and has_data:
            ax.set_xscale("log")
    axes[0].set_ylabel("fraction of samples")
    axes[-1].legend(loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_itl_over_time(path: Path, runs: dict[str, list[RequestResult]], title: str = "") -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.8))
    any_data = False
    for label, results in runs.items():
        xs, ys = [], []
        for r in results:
            if r.ok:
                xs += r.chunk_times[1:]
                ys += [max(x * 1000, 1e-3) for x in r.itls]
        if xs:
            ax.scatter(xs, ys, s=3, alpha=0.5, label=label)
            any_data = True
    ax.set_xlabel("time since bench start (s)")
    ax.set_ylabel("ITL (ms)")
    if any_data:
        ax.set_yscale("log")
        ax.legend(loc="upper right", markerscale=4)
    ax.grid(alpha=0.3)
    ax.set_title(title or "inter-token latency over time")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_plots(out: Path, runs: dict[str, list[RequestResult]], title: str = "") -> list[Path]:
    """The PNGs; none (with a note on stderr) when matplotlib is not installed."""
    out.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("no plots: matplotlib is not installed (pip install 'pdserve[bench]')", file=sys.stderr)
        return []
    return [plot_cdfs(out / "latency_cdf.png", runs, title),
            plot_itl_over_time(out / "itl_over_time.png", runs, title)]


def text_summary(summary: dict) -> str:
    """A few lines for the terminal."""
    s = summary
    lines = [
        f"requests: {s['completed']}/{s['num_requests']} completed, {s['failed']} failed, "
        f"{s['short_outputs']} short, in {s['duration_s']:.2f} s",
        f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} out tok/s, "
        f"{s['total_token_throughput']:.1f} total tok/s; goodput {s['goodput']:.2f} req/s "
        f"({s['goodput_fraction'] * 100:.0f}%)",
        f"{'ms':<6}{'mean':>9}{'p50':>9}{'p90':>9}{'p99':>9}{'max':>9}",
    ]
    for key, name in (("ttft_s", "TTFT"), ("itl_s", "ITL"), ("tpot_s", "TPOT"), ("e2e_s", "e2e")):
        d = s[key]
        cells = "".join(f"{fmt_ms(d[k]):>9}" for k in ("mean", "p50", "p90", "p99", "max"))
        lines.append(f"{name:<6}{cells}")
    for e in s["errors"]:
        lines.append(f"error: {e}")
    return "\n".join(lines)
