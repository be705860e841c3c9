"""Decode-side prefix reuse (issue 14, benchmark c): 1 prefill + 1 decode behind the router, run once
with the decode's prefix cache off (`pdserve decode --disable-prefix-cache`) and once on (the
default), each under the same multi-turn chat workload (loadtest/multiturn.py). The figure is the KV
bytes moved per request over turns 4..6 (the rise of the decode's
`pdserve_worker_transfer_bytes_total` over each turn / its requests; the prefill's cache is on in
both runs), as the ratio on / off (aim <= 0.3).

    python benchmarks/decode_reuse.py --conversations 2 --turns 6 --turn-len 200 --output-len 16 \\
        --out docs/bench/decode_reuse.json

Bytes do not depend on timing, so a busy box changes the run time, not the figure.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.procs import free_port  # noqa: E402
from loadtest import promtext  # noqa: E402
from loadtest.client import ClientConfig  # noqa: E402
from loadtest.multiturn import MultiTurnConfig, run_multi_turn, turn_table  # noqa: E402
from loadtest.services import ALWAYS_PD, LocalServices  # noqa: E402
from loadtest.workload import load_tokenizer  # noqa: E402

RUNS = (("reuse_off", ["--disable-prefix-cache"]), ("reuse_on", []))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=2, help="conversations (run in lockstep turns)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--turn-len", type=int, default=200, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=16, help="tokens of each reply")
    p.add_argument("--system-prompt-len", type=int, default=0, help="shared system prompt tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    p.add_argument("--from-turn", type=int, default=4, help="first turn of the quoted bytes per request")
    p.add_argument("--out", default="decode_reuse.json", help="JSON output file")
    return p.parse_args()


def start(svc: LocalServices, name: str, decode_flags: list[str], threads: int) -> tuple[str, str]:
    """1 prefill, 1 decode (with `decode_flags`) and a router; returns (router URL, decode URL)."""
    py = [sys.executable, "-m", "pdserve"]
    common = ["--host", "127.0.0.1", "--device", "cpu", "--threads", str(threads)]
    pre, boot, dec = free_port(), free_port(), free_port()
    svc.spawn(f"{name}-prefill", py + ["prefill", *common, "--port", str(pre), "--bootstrap-port", str(boot)])
    svc.spawn(f"{name}-decode", py + ["decode", *common, "--port", str(dec), *ALWAYS_PD, *decode_flags])
    svc.wait_healthy([f"http://127.0.0.1:{pre}/health", f"http://127.0.0.1:{dec}/health"], 600)
    rtr = free_port()
    svc.spawn(f"{name}-router", py + ["router", "--host", "127.0.0.1", "--port", str(rtr),
                                     "--prefill", f"http://127.0.0.1:{pre},bootstrap_port={boot}",
                                     "--decode", f"http://127.0.0.1:{dec}"])
    url = f"http://127.0.0.1:{rtr}"
    svc.wait_healthy([url + "/health"], 120)
    return url, f"http://127.0.0.1:{dec}"


def decode_counters(url: str) -> dict[str, float]:
    """The decode's reuse counters from /metrics (NaN when absent)."""
    parsed = promtext.parse(httpx.get(url + "/metrics", timeout=10).text)
    out = {"transfer_bytes_reused_total": promtext.total(parsed, "pdserve_worker_transfer_bytes_reused_total")}
    for name in ("kv_pages_reused_on_decode", "kv_prefix_refused_by_prefill"):
        out[name] = promtext.total(parsed, f"pdserve_worker_{name}_total")
    return out


async def one(url: str, dec: str, mt: MultiTurnConfig) -> list[dict]:
    cfg = ClientConfig(base_url=url, model="bench", endpoint="chat", timeout_s=600)
    results, rows = await run_multi_turn(cfg, mt, load_tokenizer(None), concurrency=None, kv_metrics_urls=[dec])
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    return rows


def per_request(rows: list[dict], first: int) -> float:
    """KV bytes per request over the turns from `first` on."""
    late = [r for r in rows if r["turn"] >= first]
    return sum(r["kv_bytes_per_request"] * r["requests"] for r in late) / sum(r["requests"] for r in late)


def main() -> int:
    a = parse()
    mt = MultiTurnConfig(a.conversations, a.turns, a.turn_len, a.output_len, a.system_prompt_len)
    uptime = {"before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    runs: dict[str, list[dict]] = {}
    counters: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as logs, LocalServices(Path(logs)) as svc:
        for name, flags in RUNS:
            url, dec = start(svc, name, flags, a.threads)
            runs[name] = asyncio.run(one(url, dec, mt))
            counters[name] = decode_counters(dec)
            print(f"== {name} {counters[name]}\n{turn_table(runs[name])}", flush=True)
            svc.stop_all()
    uptime["after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    off, on = per_request(runs["reuse_off"], a.from_turn), per_request(runs["reuse_on"], a.from_turn)
    doc = {"config": vars(a), "uptime": uptime, "by_turn": runs, "decode_counters": counters,
           "kv_bytes_per_request_turns_from": a.from_turn, "kv_bytes_per_request_off": off,
           "kv_bytes_per_request_on": on, "ratio_on_over_off": on / off}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"KV bytes per request, turns {a.from_turn}-{a.turns}: reuse off {off / 2**20:.2f} MiB, "
          f"on {on / 2**20:.2f} MiB, ratio on/off {on / off:.3f}")
    print(f"uptime before: {uptime['before']}\nuptime after:  {uptime['after']}\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
