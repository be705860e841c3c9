"""HiCache (issue 39): the prefix cache's host (and disk) tier on vs off under multi-turn chat whose KV
is about 4x the device pool. Real services on the embedded SmolLM2-135M: colocated, and PD (prefill +
decode + router, every prompt disaggregated), each with the tier off, a host tier, and a small host
tier over a disk tier, all in one invocation on the same workload (`pdserve bench --conversations`
traffic, loadtest/multiturn.py: turn t of every conversation, then turn t+1, so 15 other histories
pass through the pool before a conversation comes back).

`--engine` runs the same traffic (token ids, greedy) through the engine's Scheduler in this process
instead of services (colocated only: no HTTP, no router, no model load per run), for a machine too
busy for six services; TTFT is then add-to-first-token in the scheduler loop.

Reported per run: prefix hit rate (cached / prompt tokens, usage.cached_tokens), prompt tokens
computed, TTFT p50 over turns 4-6, and the workers' per-tier counters from /server_info.

    python benchmarks/hicache.py --out docs/bench/hicache.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.procs import free_port  # noqa: E402
from loadtest.client import ClientConfig  # noqa: E402
from loadtest.multiturn import MultiTurnConfig, run_multi_turn  # noqa: E402
from loadtest.services import ALWAYS_PD, LocalServices  # noqa: E402
from loadtest.workload import load_tokenizer  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--turn-len", type=int, default=32, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=8, help="tokens of each reply")
    p.add_argument("--pool-tokens", type=int, default=1280,
                   help="--max-total-tokens of every worker (default: about 1/4 of the conversations' final KV)")
    p.add_argument("--host-tokens", type=int, default=16384, help="--hicache-host-tokens of the host runs")
    p.add_argument("--disk-host-tokens", type=int, default=512,
                   help="--hicache-host-tokens of the host+disk runs (small: most hits come from disk)")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight (1: TTFT without queueing)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of each worker")
    p.add_argument("--modes", default="colocated,pd", help="comma list: colocated, pd")
    p.add_argument("--from-turn", type=int, default=4, help="first turn of the quoted TTFT p50")
    p.add_argument("--engine", action="store_true", help="in-process Scheduler instead of services (colocated)")
    p.add_argument("--out", default="hicache.json", help="JSON output file")
    return p.parse_args()


def tiers(a: argparse.Namespace, disk_dir: str) -> list[tuple[str, list[str]]]:
    return [("off", []),
            ("host", ["--hicache-host-tokens", str(a.host_tokens)]),
            ("host+disk", ["--hicache-host-tokens", str(a.disk_host_tokens), "--hicache-dir", disk_dir,
                           "--hicache-disk-bytes", str(1 << 30)])]


def start(svc: LocalServices, mode: str, name: str, flags: list[str], a: argparse.Namespace) -> tuple[str, list[str]]:
    """Spawn the services of one run (not waited for); returns (URL the client talks to, worker URLs)."""
    py = [sys.executable, "-m", "pdserve"]
    common = ["--host", "127.0.0.1", "--device", "cpu", "--threads", str(a.threads),
              "--max-total-tokens", str(a.pool_tokens), "--log-level", "warning", *flags]
    if mode == "colocated":
        port = free_port()
        svc.spawn(name, py + ["colocated", *common, "--port", str(port)])
        url = f"http://127.0.0.1:{port}"
        return url, [url]
    pre, boot, dec, rtr = free_port(), free_port(), free_port(), free_port()
    svc.spawn(f"{name}-prefill", py + ["prefill", *common, "--port", str(pre), "--bootstrap-port", str(boot)])
    svc.spawn(f"{name}-decode", py + ["decode", *common, "--port", str(dec), *ALWAYS_PD])
    workers = [f"http://127.0.0.1:{pre}", f"http://127.0.0.1:{dec}"]
    svc.spawn(f"{name}-router", py + ["router", "--host", "127.0.0.1", "--port", str(rtr),
                                     "--prefill", f"{workers[0]},bootstrap_port={boot}", "--decode", workers[1]])
    return f"http://127.0.0.1:{rtr}", workers


async def one(url: str, mt: MultiTurnConfig, a: argparse.Namespace) -> dict:
    cfg = ClientConfig(base_url=url, model="bench", endpoint="chat", timeout_s=600)
    results, _ = await run_multi_turn(cfg, mt, load_tokenizer(None), concurrency=a.concurrency)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    prompt = sum(r.server_prompt_tokens or r.prompt_len for r in results)
    cached = sum(r.cached_tokens or 0 for r in results)
    late = [r.ttft for r in results if int(r.tag.removeprefix("turn")) + 1 >= a.from_turn and r.ttft is not None]
    if not late:
        raise ValueError(f"--from-turn {a.from_turn} is past --turns {a.turns}")
    return {"requests": len(results), "prompt_tokens": prompt, "cached_tokens": cached,
            "hit_rate": cached / prompt, "computed_tokens": prompt - cached,
            "ttft_p50_late_s": float(np.percentile(late, 50))}


def engine_run(a: argparse.Namespace, flags: list[str]) -> dict:
    """The workload through an in-process Scheduler on the embedded model (one request at a time)."""
    import random
    import time

    from engine.config import EngineConfig
    from engine.forward.model_runner import ModelRunner
    from engine.models.embedded import embedded_model_dir
    from engine.request import Req
    from engine.sampling.params import SamplingParams
    from engine.scheduling.scheduler import Scheduler

    kw = dict(zip(flags[::2], flags[1::2]))
    cfg = EngineConfig(model=str(embedded_model_dir()), max_total_tokens=a.pool_tokens, threads=a.threads,
                       prefix_cache=True, hicache_host_tokens=int(kw.get("--hicache-host-tokens", 0)),
                       hicache_dir=kw.get("--hicache-dir", ""))
    sched = Scheduler(ModelRunner(cfg), cfg)
    rng = random.Random(0)
    sp = SamplingParams(temperature=0.0, max_new_tokens=a.output_len, ignore_eos=True)
    hist = [[rng.randrange(1000, 40000) for _ in range(a.turn_len)] for _ in range(a.conversations)]
    prompt = cached = 0
    late: list[float] = []
    for t in range(a.turns):
        for c in range(a.conversations):
            ids = hist[c] + [rng.randrange(1000, 40000) for _ in range(a.turn_len if t else 0)]
            r = Req(rid=f"c{c}t{t}", token_ids=list(ids), sampling=sp)
            t0, ttft = time.perf_counter(), None
            sched.add(r)
            while not r.finished:
                sched.step()
                sched.drain()
                if ttft is None and r.num_output_tokens:
                    ttft = time.perf_counter() - t0
            assert r.error is None, r.error
            prompt, cached = prompt + len(ids), cached + r.kv.cached_tokens
            if t + 1 >= a.from_turn:
                late.append(ttft or 0.0)
            hist[c] = ids + r.output_ids
    out = {"requests": a.conversations * a.turns, "prompt_tokens": prompt, "cached_tokens": cached,
           "hit_rate": cached / prompt, "computed_tokens": prompt - cached,
           "ttft_p50_late_s": float(np.percentile(late, 50)),
           "final_kv_tokens": sum(len(h) for h in hist), "pool_tokens": sched.kv.pool.total_tokens,
           "workers": [{"hicache": sched.kv.cache_stats().tiers}]}
    sched.kv.flush()
    return out


def worker_tiers(urls: list[str]) -> list[dict]:
    out = []
    for u in urls:
        st = httpx.get(u + "/server_info", timeout=10).json()["internal_states"][0]
        out.append({"role": st.get("role"), "prefix_hit_tokens": st.get("prefix_hit_tokens"),
                    "kv_total_tokens": st.get("kv_total_tokens"), "hicache": st.get("hicache", {})})
    return out


def table(rows: list[dict]) -> str:
    lines = [f"{'mode':<10}{'tier':<11}{'hit rate':>9}{'computed':>10}{'TTFT p50 t4-6 ms':>18}"
             f"{'hit x off':>10}{'TTFT / off':>11}"]
    base = {r["mode"]: r for r in rows if r["tier"] == "off"}
    for r in rows:
        b = base.get(r["mode"], r)
        lines.append(f"{r['mode']:<10}{r['tier']:<11}{r['hit_rate']:>9.3f}{r['computed_tokens']:>10}"
                     f"{r['ttft_p50_late_s'] * 1000:>18.0f}{r['hit_rate'] / max(b['hit_rate'], 1e-9):>10.2f}"
                     f"{r['ttft_p50_late_s'] / b['ttft_p50_late_s']:>11.2f}")
    return "\n".join(lines)


def main() -> int:
    a = parse()
    mt = MultiTurnConfig(a.conversations, a.turns, a.turn_len, a.output_len)
    uptime = {"before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, LocalServices(Path(tmp) / "logs") as svc:
        for tier, flags in tiers(a, str(Path(tmp) / "disk")) if a.engine else []:
            rows.append({"mode": "engine", "tier": tier, **engine_run(a, flags)})
            print(f"== engine {tier}: {json.dumps({k: v for k, v in rows[-1].items() if k != 'workers'})}", flush=True)
        # a mode's three runs start together (their loads overlap), then run in turn
        for mode in [] if a.engine else a.modes.split(","):
            print(f"== {mode}: starting (logs in {svc.log_dir})", flush=True)
            runs = [(tier, *start(svc, mode, f"{mode}-{tier.replace('+', '-')}", flags, a))
                    for tier, flags in tiers(a, str(Path(tmp) / "disk"))]
            svc.wait_healthy([u + "/health" for _, url, workers in runs for u in (*workers, url)], 1200)
            for tier, url, workers in runs:
                row = {"mode": mode, "tier": tier, **asyncio.run(one(url, mt, a)), "workers": worker_tiers(workers)}
                rows.append(row)
                print(f"== {mode} {tier}: hit rate {row['hit_rate']:.3f}, computed {row['computed_tokens']}, "
                      f"TTFT p50 turns {a.from_turn}+ {row['ttft_p50_late_s'] * 1000:.0f} ms", flush=True)
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                Path(a.out).write_text(json.dumps({"config": vars(a), "uptime": uptime, "runs": rows}, indent=1))
            svc.stop_all()
    uptime["after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    doc = {"config": vars(a), "uptime": uptime, "runs": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(table(rows))
    print(f"uptime before: {uptime['before']}\nuptime after:  {uptime['after']}\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
