"""Latency the router adds, and its max request rate, against null backends that answer at once.

Starts two null workers (one as prefill, one as decode) and the routers under test (router_common:
this checkout, optional baselines, sglang-router), each in its own process. For each concurrency it
sends N non-streaming `/generate` requests directly to the null decode and the same N through each
router, interleaved over `--rounds` rounds. Reports per concurrency and target: p50/p99 latency, the
added p50/p99 over direct, and req/s (the median of the rounds).

    python benchmarks/router_overhead.py --requests 2000 --concurrency 1,32 \
        --sglang-router /tmp/sglr-venv/bin/python --out bench_out/router_overhead.json

Note: a router makes two backend calls per request (prefill and decode) where the direct path makes one.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import orjson
from router_common import Bench, Target, add_router_flags, client_pool, interleaved, pct, run_bench, serve_null

BODY = orjson.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 1}})


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


async def _run(t: Target, n: int, concurrency: int) -> dict:
    """n POSTs with `concurrency` in flight; latencies in ms and the achieved rate."""
    lat: list[float] = []
    errors = 0
    pool = client_pool(concurrency)
    try:
        await (await pool.post(t.url, "/generate", BODY)).read()  # warm a connection
        it = iter(range(n))

        async def worker() -> None:
            nonlocal errors
            for _ in it:
                start = time.perf_counter()
                r = await pool.post(t.url, "/generate", BODY)
                await r.read()
                lat.append((time.perf_counter() - start) * 1e3)
                errors += r.status != 200

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    finally:
        pool.close()
    return {"lat": lat, "rps": n / wall, "errors": errors}


def measure(bench: Bench, n: int, levels: list[int], rounds: int) -> dict:
    rows = []
    for c in levels:
        runs = interleaved(bench, rounds, lambda t, c=c: _run(t, n, c))
        row: dict = {"concurrency": c, "requests": n, "rounds": rounds, "targets": {}}
        for label, results in runs.items():
            lat = [x for r in results for x in r["lat"]]
            row["targets"][label] = {
                "p50_ms": statistics.median(lat),
                "p99_ms": pct(lat, 0.99),
                "rps": statistics.median(r["rps"] for r in results),
                "rps_rounds": [r["rps"] for r in results],
                "errors": sum(r["errors"] for r in results),
                "router_cpu_us_per_request": 1e6 * sum(r["router_cpu_s"] for r in results) / (n * rounds),
            }
        direct = row["targets"]["direct"]
        for x in row["targets"].values():
            x["added_p50_ms"] = x["p50_ms"] - direct["p50_ms"]
            x["added_p99_ms"] = x["p99_ms"] - direct["p99_ms"]
        rows.append(row)
    return {"rows": rows}


def _table(result: dict) -> str:
    head = f"{'conc':>5} {'target':<22} {'p50':>9} {'p99':>9} {'added p50':>10} {'added p99':>10} {'req/s':>7}"
    lines = [head + f" {'cpu/req':>9} err"]
    for row in result["rows"]:
        for label, x in row["targets"].items():
            lines.append(
                f"{row['concurrency']:>5} {label:<22} {x['p50_ms']:>7.2f}ms {x['p99_ms']:>7.2f}ms "
                f"{x['added_p50_ms']:>8.2f}ms {x['added_p99_ms']:>8.2f}ms {x['rps']:>7.0f} "
                f"{x['router_cpu_us_per_request']:>7.0f}us {x['errors']}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000, help="requests per concurrency level, target and round")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    p.add_argument("--out", default="bench_out/router_overhead.json", help="JSON result file")
    p.add_argument("--serve-null", default=None, metavar="ROLE:PORT", help=argparse.SUPPRESS)
    add_router_flags(p)
    a = p.parse_args(argv)
    if a.serve_null:  # child process mode: one null worker
        return serve_null(a.serve_null, null_app)
    levels = [int(x) for x in a.concurrency.split(",")]
    if a.requests < 1 or not levels or min(levels) < 1 or a.rounds < 1:
        p.error("--requests, --rounds and every --concurrency level must be >= 1")
    return run_bench(__file__, a, lambda bench: measure(bench, a.requests, levels, a.rounds), _table)


if __name__ == "__main__":
    sys.exit(main())
