"""Prefix cache on vs off (issue 14, benchmark a): one colocated service (embedded SmolLM2-135M) run
twice in the same invocation, `--disable-prefix-cache` and default, each under the same multi-turn
chat workload (`pdserve bench --conversations`, loadtest/multiturn.py). The figure is TTFT p50 over
turns 4..6 (later turns carry the whole history: with the cache only the new message and the
partial last page are computed), as the ratio off / on.

    python benchmarks/prefix_cache.py --conversations 4 --turns 6 --turn-len 200 --output-len 16 \\
        --out docs/bench/prefix_cache.json
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.procs import free_port  # noqa: E402
from loadtest.client import ClientConfig  # noqa: E402
from loadtest.multiturn import MultiTurnConfig, run_multi_turn, turn_table  # noqa: E402
from loadtest.services import LocalServices  # noqa: E402
from loadtest.workload import load_tokenizer  # noqa: E402


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=4, help="conversations (run in lockstep turns)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--turn-len", type=int, default=200, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=16, help="tokens of each reply")
    p.add_argument("--system-prompt-len", type=int, default=0, help="shared system prompt tokens")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the service")
    p.add_argument("--from-turn", type=int, default=4, help="first turn of the quoted TTFT p50")
    p.add_argument("--out", default="prefix_cache.json", help="JSON output file")
    return p.parse_args()


async def one(url: str, mt: MultiTurnConfig, first: int) -> tuple[list[dict], float]:
    """(per-turn rows, TTFT p50 over every request of turns `first`..)."""
    cfg = ClientConfig(base_url=url, model="bench", endpoint="chat", timeout_s=600)
    results, rows = await run_multi_turn(cfg, mt, load_tokenizer(None), concurrency=None)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    late = [r.ttft for r in results if int(r.tag.removeprefix("turn")) + 1 >= first]
    return rows, float(np.percentile(late, 50))


def main() -> int:
    a = parse()
    mt = MultiTurnConfig(a.conversations, a.turns, a.turn_len, a.output_len, a.system_prompt_len)
    uptime = {"before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    runs: dict[str, list[dict]] = {}
    p50: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as logs, LocalServices(Path(logs)) as svc:
        for name, extra in (("cache_off", ["--disable-prefix-cache"]), ("cache_on", [])):
            port = free_port()
            svc.spawn(name, [sys.executable, "-m", "pdserve", "colocated", "--port", str(port), "--device", "cpu",
                             "--threads", str(a.threads), *extra])
            svc.wait_healthy([f"http://127.0.0.1:{port}/health"], 600)
            runs[name], p50[name] = asyncio.run(one(f"http://127.0.0.1:{port}", mt, a.from_turn))
            print(f"== {name}\n{turn_table(runs[name])}", flush=True)
            svc.stop_all()
    uptime["after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    off, on = p50["cache_off"], p50["cache_on"]
    doc = {"config": vars(a), "uptime": uptime, "by_turn": runs, "ttft_p50_turns_from": a.from_turn,
           "ttft_p50_off_s": off, "ttft_p50_on_s": on, "ratio_off_over_on": off / on}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"TTFT p50, turns {a.from_turn}-{a.turns}: cache off {off * 1000:.0f} ms, on {on * 1000:.0f} ms, "
          f"ratio off/on {off / on:.2f}x")
    print(f"uptime before: {uptime['before']}\nuptime after:  {uptime['after']}\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
