"""Latency the router adds, and its max request rate, against null backends that answer at once.

Starts two null workers (one as prefill, one as decode) and a router, each in its own process, then for
each concurrency sends N non-streaming `/generate` requests directly to the null decode and the same N
through the router, in the same run. Reports per concurrency: p50/p99 latency direct and via router,
the added p50/p99, and req/s both ways; `max_rps_router` is the best router rate seen.

    python benchmarks/router_overhead.py --requests 2000 --concurrency 1,8,32 --out bench_out/router.json

Note: the router makes two backend calls per request (prefill and decode) where the direct path makes one.
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
from common.procs import Child, free_port, stop_all, wait_until  # noqa: E402

BODY = {"text": "hello", "sampling_params": {"max_new_tokens": 1}}


def null_app(role: str, port: int):
    """A worker that answers every call at once (FastAPI + uvicorn, like the real services)."""
    from fastapi import FastAPI

    app = FastAPI()
    answer = {"text": "x", "meta_info": {"id": "null", "prompt_tokens": 1, "completion_tokens": 1}}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/server_info")
    async def server_info():
        return {"role": role, "bootstrap_port": port, "model": "null", "served_model_name": "null"}

    @app.post("/generate")
    async def generate():
        return answer

    @app.post("/abort_request")
    async def abort():
        return {}

    return app


def _spawn(name: str, args: list[str], log_dir: Path, url: str) -> Child:
    return Child(name, [sys.executable, *args], log_dir / f"{name}.log", url=url, env={"PYTHONPATH": str(ROOT)},
                 cwd=ROOT)


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def _run(url: str, n: int, concurrency: int) -> dict:
    """n POSTs to url with `concurrency` in flight; latencies in ms and the achieved rate."""
    lat: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        await client.post(url, json=BODY)  # warm the connection
        it = iter(range(n))

        async def worker() -> None:
            nonlocal errors
            for _ in it:
                t = time.perf_counter()
                r = await client.post(url, json=BODY)
                lat.append((time.perf_counter() - t) * 1e3)
                errors += r.status_code != 200

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"p50_ms": statistics.median(lat), "p99_ms": _pct(lat, 0.99), "rps": n / wall, "errors": errors}


def measure(direct_url: str, router_url: str, n: int, levels: list[int]) -> dict:
    rows = []
    for c in levels:
        d = asyncio.run(_run(direct_url, n, c))
        r = asyncio.run(_run(router_url, n, c))
        rows.append(
            {
                "concurrency": c,
                "requests": n,
                "direct": d,
                "router": r,
                "added_p50_ms": r["p50_ms"] - d["p50_ms"],
                "added_p99_ms": r["p99_ms"] - d["p99_ms"],
            }
        )
    return {
        "rows": rows,
        "max_rps_router": max(x["router"]["rps"] for x in rows),
        "max_rps_direct": max(x["direct"]["rps"] for x in rows),
    }


def _table(result: dict) -> str:
    head = (
        f"{'conc':>5} {'direct p50':>11} {'p99':>8} {'router p50':>11} {'p99':>8} {'added p50':>10} "
        f"{'p99':>8} {'direct rps':>11} {'router rps':>11}"
    )
    lines = [head]
    for x in result["rows"]:
        d, r = x["direct"], x["router"]
        lines.append(
            f"{x['concurrency']:>5} {d['p50_ms']:>9.2f}ms {d['p99_ms']:>6.2f}ms {r['p50_ms']:>9.2f}ms "
            f"{r['p99_ms']:>6.2f}ms {x['added_p50_ms']:>8.2f}ms {x['added_p99_ms']:>6.2f}ms "
            f"{d['rps']:>11.0f} {r['rps']:>11.0f}"
        )
    lines.append(
        f"max req/s via router: {result['max_rps_router']:.0f} (direct: {result['max_rps_direct']:.0f})"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000, help="requests per concurrency level and path")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--out", default="bench_out/router_overhead.json", help="JSON result file")
    p.add_argument("--serve-null", default=None, metavar="ROLE:PORT", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.serve_null:  # child process mode: one null worker
        import uvicorn

        role, port = a.serve_null.split(":")
        uvicorn.run(null_app(role, int(port)), host="127.0.0.1", port=int(port), log_level="warning")
        return 0
    levels = [int(x) for x in a.concurrency.split(",")]
    if a.requests < 1 or not levels or min(levels) < 1:
        p.error("--requests and every --concurrency level must be >= 1")
    pp, dp, rp = free_port(), free_port(), free_port()
    me = str(Path(__file__).resolve())
    log_dir = Path(tempfile.mkdtemp(prefix="router-overhead-"))
    router = ["-m", "router.main", "--port", str(rp), "--prefill", f"http://127.0.0.1:{pp}",
              "--decode", f"http://127.0.0.1:{dp}", "--log-level", "warning"]
    procs = [
        _spawn("prefill", [me, "--serve-null", f"prefill:{pp}"], log_dir, f"http://127.0.0.1:{pp}"),
        _spawn("decode", [me, "--serve-null", f"decode:{dp}"], log_dir, f"http://127.0.0.1:{dp}"),
        _spawn("router", router, log_dir, f"http://127.0.0.1:{rp}"),
    ]
    try:
        for c in procs:
            wait_until(c.healthy, 60, f"{c.name} healthy", interval=0.1)
        result = measure(
            f"http://127.0.0.1:{dp}/generate", f"http://127.0.0.1:{rp}/generate", a.requests, levels
        )
    finally:
        stop_all(procs, 10)
    result["cpu_count"] = os.cpu_count()
    print(_table(result))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
