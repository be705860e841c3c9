"""A burst of huge prompts beside running streams: does the service's event loop keep relaying tokens?

For each code tree under test (`--root LABEL=PATH`, e.g. the tree before and after a change), start
`pdserve colocated --threads 2` from that tree on the embedded model, then:

  1. open `--streams` streaming chat requests of `--tokens` tokens each (ignore_eos);
  2. once every stream has `--warm-events` events, send `--burst` concurrent chat requests whose
     prompts have `--burst-chars` characters (too long for the context: each is refused with 400,
     after it was tokenized or, where the length alone proves it, before);
  3. per stream, the largest gap between two events before the burst and while it runs (from the
     burst's start to its last answer); the slowest of back-to-back GET /health probes during the
     burst (the loop's own delay: the stream gaps also hold the worker's step time, which CPU
     contention from tokenization stretches on a small machine); the burst's wall time and statuses.

The trees run one after the other on the same machine, `--rounds` times interleaved; the figures are
the median over rounds of the largest gap of any stream. Prints a table and writes `--out` (JSON).

    python benchmarks/frontend_burst.py --root before=/tmp/base --root after=. --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.procs import Child, free_port, wait_until  # noqa: E402

WORDS = "lorem ipsum dolor sit amet "
KEYS = ("gap_before_s", "gap_during_s", "health_max_s", "burst_wall_s")


def _chat(text: str, max_tokens: int, stream: bool) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def _stream(c: httpx.AsyncClient, url: str, i: int, tokens: int, times: list[float]) -> int:
    async with c.stream("POST", url + "/v1/chat/completions", json=_chat(f"story {i}: once", tokens, True)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
        return r.status_code


async def _big(c: httpx.AsyncClient, url: str, chars: int, i: int) -> int:
    text = (f"{i} " + WORDS * (chars // len(WORDS) + 1))[:chars]
    r = await c.post(url + "/v1/chat/completions", json=_chat(text, 8, False))
    return r.status_code


async def _probe(c: httpx.AsyncClient, url: str, until: asyncio.Event, lat: list[float]) -> None:
    """GET /health back to back until `until` is set: each answer's latency is the loop's delay."""
    while not until.is_set():
        t = time.monotonic()
        await c.get(url + "/health")
        lat.append(time.monotonic() - t)


def _max_gap(times: list[float], lo: float, hi: float) -> float:
    """Largest gap between consecutive events whose interval overlaps [lo, hi] (from lo if none after)."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b >= lo and a <= hi]
    if times and times[-1] < hi:  # the stream went silent until the burst ended
        gaps.append(hi - max(times[-1], lo))
    return max(gaps, default=0.0)


async def one_round(url: str, a: argparse.Namespace) -> dict:
    """Streams, then the burst beside them; the gaps in seconds."""
    async with httpx.AsyncClient(timeout=600) as c:
        times: list[list[float]] = [[] for _ in range(a.streams)]
        streams = [asyncio.create_task(_stream(c, url, i, a.tokens, times[i])) for i in range(a.streams)]
        while min(len(t) for t in times) < a.warm_events:
            await asyncio.wait(streams, timeout=0.01)
            if all(s.done() for s in streams):
                raise RuntimeError("the streams ended before the burst; raise --tokens")
        done, lat = asyncio.Event(), []
        probe = asyncio.create_task(_probe(c, url, done, lat))
        b0 = time.monotonic()
        statuses = await asyncio.gather(*(_big(c, url, a.burst_chars, i) for i in range(a.burst)))
        b1 = time.monotonic()
        done.set()
        await probe
        stream_status = await asyncio.gather(*streams)
    before = [_max_gap([x for x in t[1:] if x <= b0], 0.0, b0) for t in times]  # t[0]: the first token
    during = [_max_gap(t, b0, b1) for t in times]
    return {"gap_before_s": max(before), "gap_during_s": max(during), "burst_wall_s": b1 - b0,
            "health_max_s": max(lat), "health_probes": len(lat),
            "burst_status": sorted(set(statuses)), "stream_status": sorted(set(stream_status))}


def start(root: Path, label: str, logs: Path) -> Child:
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "colocated", "--port", str(port), "--threads", "2",
           "--log-level", "warning"]
    child = Child(label, cmd, logs / f"{label}.log", url=f"http://127.0.0.1:{port}", cwd=root,
                  env={"PYTHONPATH": str(root)})
    wait_until(child.healthy, 600, f"{label} healthy")
    return child


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", action="append", default=[], help="LABEL=PATH of a tree to run (repeat)")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--tokens", type=int, default=160)
    p.add_argument("--warm-events", type=int, default=16)
    p.add_argument("--burst", type=int, default=8)
    p.add_argument("--burst-chars", type=int, default=400_000)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "frontend_burst.json")
    a = p.parse_args()
    roots = [(r.split("=", 1)[0], Path(r.split("=", 1)[1]).resolve()) for r in a.root] or [("this", ROOT)]
    runs: dict[str, list[dict]] = {label: [] for label, _ in roots}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for label, root in roots:
                child = start(root, label, Path(tmp))
                try:
                    runs[label].append(asyncio.run(one_round(child.url, a)))
                finally:
                    child.stop()
                print(f"round {rnd} {label}: " + json.dumps(runs[label][-1]), flush=True)
    summary = {label: {k: statistics.median(r[k] for r in rs) for k in KEYS}
               for label, rs in runs.items()}
    print(f"{'tree':>8}" + "".join(f"{k.removesuffix('_s').replace('_', ' ') + ' ms':>17}" for k in KEYS))
    for label, s in summary.items():
        print(f"{label:>8}" + "".join(f"{s[k] * 1e3:17.0f}" for k in KEYS))
    labels = list(summary)
    ratio = (summary[labels[0]]["gap_during_s"] / summary[labels[-1]]["gap_during_s"]) if len(labels) > 1 else None
    if ratio is not None:
        health = summary[labels[0]]["health_max_s"] / summary[labels[-1]]["health_max_s"]
        print(f"during the burst, {labels[0]} / {labels[-1]}: largest stream gap {ratio:.1f}x, "
              f"slowest /health {health:.1f}x")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "cpus": os.cpu_count(),
                                 "loadavg": os.getloadavg(), "runs": runs, "median": summary,
                                 "during_ratio_first_over_last": ratio}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
