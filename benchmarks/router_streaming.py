"""Token streams through the router: events/s relayed and the latency each event gains on the way.

Starts a null prefill and a null decode (plain ASGI on uvicorn) and the routers under test
(router_common). The null decode answers a streaming `/generate` with `--events` SSE events, one every
`--interval-ms`, each stamped with the sender's monotonic clock (`"t"`, ns), then `data: [DONE]`; the
null prefill answers at once (a real prefill ends after its first token). For each number of
concurrent streams, clients open `--requests` streams (that many in flight at a time) directly to
the decode and through each router, interleaved over `--rounds` rounds, and report:

- events/s received (all streams; the median of the rounds) and its ratio to direct,
- per-event latency (receive time minus the stamp) p50/p99, and the part a router adds over direct,
- the router process's CPU per event (load on the machine hardly changes it).

    python benchmarks/router_streaming.py --streams 64,256 --events 64 --interval-ms 10 \\
        --sglang-router /tmp/sglr-venv/bin/python --out bench_out/router_streaming.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import orjson
from router_common import Bench, Target, add_router_flags, client_pool, interleaved, pct, run_bench, serve_null

_DONE = b"data: [DONE]\n\n"


def null_stream_app(role: str, port: int):
    """A worker whose streaming answers tick at a fixed rate (plain ASGI: cheap, so the router shows)."""
    info = orjson.dumps({"role": role, "bootstrap_port": port, "model": "null", "served_model_name": "null"})
    unary = orjson.dumps({"text": "x", "meta_info": {"id": "null", "prompt_tokens": 1, "completion_tokens": 1}})
    json_head = [(b"content-type", b"application/json")]

    async def body_of(receive) -> bytes:
        parts = []
        while True:
            msg = await receive()
            parts.append(msg.get("body", b""))
            if not msg.get("more_body"):
                return b"".join(parts)

    async def stream(send, n: int, interval_s: float) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        loop = asyncio.get_running_loop()
        due = loop.time()
        for i in range(n):
            event = b'data: {"text":"x","meta_info":{"id":"null","completion_tokens":%d,"t":%d}}\n\n' % (
                i + 1,
                time.monotonic_ns(),
            )
            await send({"type": "http.response.body", "body": event, "more_body": True})
            due += interval_s
            await asyncio.sleep(max(0.0, due - loop.time()))
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        path = scope["path"]
        if path == "/generate":
            body = orjson.loads(await body_of(receive))
            if body.get("stream") and role == "decode":
                n = body["sampling_params"]["max_new_tokens"]
                return await stream(send, n, body.get("null_interval_ms", 10) / 1e3)
            out = unary
        elif path == "/server_info":
            out = info
        else:  # /health, /abort_request
            out = b"{}"
        await send({"type": "http.response.start", "status": 200, "headers": json_head})
        await send({"type": "http.response.body", "body": out})

    return app


async def _one_stream(pool, url: str, body: bytes, lat: list[float]) -> tuple[int, bool]:
    """One stream: (events received, ended with [DONE]); per-event latencies (ms) go into `lat`."""
    resp = await pool.post(url, "/generate", body)
    events, buf, done = 0, b"", False
    while (chunk := await resp.next_chunk()) is not None:
        now = time.monotonic_ns()
        buf += chunk
        *complete, buf = buf.split(b"\n\n")
        for ev in complete:
            i = ev.find(b'"t":')
            if i >= 0:
                events += 1
                lat.append((now - int(ev[i + 4 : ev.index(b"}", i)])) / 1e6)
            elif ev.startswith(b"data: [DONE]"):
                done = True
    return events, done


async def _run(t: Target, n: int, streams: int, events: int, interval_ms: float) -> dict:
    body = orjson.dumps(
        {
            "text": "hello",
            "stream": True,
            "sampling_params": {"max_new_tokens": events},
            "null_interval_ms": interval_ms,
        }
    )
    lat: list[float] = []
    received, errors = 0, 0
    pool = client_pool(streams)
    it = iter(range(n))

    async def client() -> None:
        nonlocal received, errors
        for _ in it:
            try:
                got, done = await _one_stream(pool, t.url, body, lat)
            except Exception:  # noqa: BLE001 - counted, the benchmark goes on
                got, done = 0, False
            received += got
            errors += got != events or not done

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(streams)))
        wall = time.perf_counter() - t0
    finally:
        pool.close()
    return {"lat": lat, "events": received, "events_per_s": received / wall, "errors": errors, "wall_s": wall}


def measure(bench: Bench, a: argparse.Namespace, levels: list[int]) -> dict:
    rows = []
    for c in levels:
        n = a.requests or c
        runs = interleaved(bench, a.rounds, lambda t, c=c, n=n: _run(t, n, c, a.events, a.interval_ms))
        row: dict = {"streams": c, "requests": n, "events_per_stream": a.events, "interval_ms": a.interval_ms}
        row["offered_events_per_s"] = c * 1e3 / a.interval_ms
        row["targets"] = {}
        for label, results in runs.items():
            lat = [x for r in results for x in r["lat"]]
            total = sum(r["events"] for r in results)
            row["targets"][label] = {
                "events_per_s": statistics.median(r["events_per_s"] for r in results),
                "events_per_s_rounds": [r["events_per_s"] for r in results],
                "event_p50_ms": statistics.median(lat) if lat else float("nan"),
                "event_p99_ms": pct(lat, 0.99),
                "errors": sum(r["errors"] for r in results),
                "router_cpu_us_per_event": 1e6 * sum(r["router_cpu_s"] for r in results) / max(1, total),
            }
        direct = row["targets"]["direct"]
        for x in row["targets"].values():
            x["vs_direct"] = x["events_per_s"] / direct["events_per_s"]
            x["added_p50_ms"] = x["event_p50_ms"] - direct["event_p50_ms"]
            x["added_p99_ms"] = x["event_p99_ms"] - direct["event_p99_ms"]
        rows.append(row)
    return {"rows": rows}


def _table(result: dict) -> str:
    head = f"{'streams':>7} {'target':<22} {'events/s':>9} {'x direct':>8} {'p50':>8} {'p99':>9}"
    lines = [head + f" {'added p50':>9} {'added p99':>9} {'cpu/event':>9} err"]
    for row in result["rows"]:
        for label, x in row["targets"].items():
            lines.append(
                f"{row['streams']:>7} {label:<22} {x['events_per_s']:>9.0f} {x['vs_direct']:>8.2f} "
                f"{x['event_p50_ms']:>6.2f}ms {x['event_p99_ms']:>7.2f}ms {x['added_p50_ms']:>7.2f}ms "
                f"{x['added_p99_ms']:>7.2f}ms {x['router_cpu_us_per_event']:>7.1f}us {x['errors']}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", default="64,256", help="comma-separated numbers of concurrent streams")
    p.add_argument("--requests", type=int, default=0, help="streams per level, target and round (0: --streams)")
    p.add_argument("--events", type=int, default=64, help="events per stream")
    p.add_argument("--interval-ms", type=float, default=10.0, help="gap between a stream's events")
    p.add_argument("--out", default="bench_out/router_streaming.json", help="JSON result file")
    p.add_argument("--serve-null", default=None, metavar="ROLE:PORT", help=argparse.SUPPRESS)
    add_router_flags(p)
    a = p.parse_args(argv)
    if a.serve_null:  # child process mode: one null worker
        return serve_null(a.serve_null, null_stream_app)
    levels = [int(x) for x in a.streams.split(",")]
    if not levels or min(levels) < 1 or a.events < 1 or a.interval_ms <= 0 or a.rounds < 1:
        p.error("--streams, --events, --rounds must be >= 1 and --interval-ms > 0")
    return run_bench(__file__, a, lambda bench: measure(bench, a, levels), _table)


if __name__ == "__main__":
    sys.exit(main())
