"""Router policy and the prefill pool's prefix caches (issue 14, benchmark b): 2 prefills + 1 decode
behind the router, run once with `--prefill-policy round_robin` and once with `cache_aware`, each
under the same multi-turn chat workload (loadtest/multiturn.py). The figure is the prefix hit rate:
cached prompt tokens / prompt tokens over turns 2.. (usage `prompt_tokens_details.cached_tokens`,
which the prefill reports with the first token), as the ratio cache_aware / round_robin.

    python benchmarks/cache_aware_routing.py --conversations 5 --turns 6 --turn-len 100 \\
        --out docs/bench/cache_aware_routing.json

Conversations run in lockstep turns. Use an odd number of them: with an even number and 2
prefills, round_robin sends every turn of a conversation to the same prefill by accident of the
lockstep order, which no real traffic does.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.procs import free_port  # noqa: E402
from loadtest.client import ClientConfig  # noqa: E402
from loadtest.multiturn import MultiTurnConfig, run_multi_turn, turn_table  # noqa: E402
from loadtest.services import ALWAYS_PD, LocalServices  # noqa: E402
from loadtest.workload import load_tokenizer  # noqa: E402

POLICIES = ("round_robin", "cache_aware")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--conversations", type=int, default=5, help="conversations (run in lockstep turns)")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--turn-len", type=int, default=100, help="tokens of each new user message")
    p.add_argument("--output-len", type=int, default=16, help="tokens of each reply")
    p.add_argument("--system-prompt-len", type=int, default=32, help="shared system prompt tokens")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each worker")
    p.add_argument("--out", default="cache_aware_routing.json", help="JSON output file")
    return p.parse_args()


def start(svc: LocalServices, policy: str, threads: int) -> str:
    """2 prefills, 1 decode and a router with `policy` for prefill; returns the router's URL."""
    py = [sys.executable, "-m", "pdserve"]
    common = ["--host", "127.0.0.1", "--device", "cpu", "--threads", str(threads)]
    prefills = []
    for i in range(2):
        port, boot = free_port(), free_port()
        svc.spawn(f"{policy}-prefill{i}", py + ["prefill", *common, "--port", str(port), "--bootstrap-port", str(boot)])
        prefills.append((port, boot))
    dec = free_port()
    svc.spawn(f"{policy}-decode", py + ["decode", *common, "--port", str(dec), *ALWAYS_PD])  # prefills do the work
    svc.wait_healthy([f"http://127.0.0.1:{p}/health" for p, _ in prefills] + [f"http://127.0.0.1:{dec}/health"], 600)
    rtr = free_port()
    svc.spawn(f"{policy}-router", py + ["router", "--host", "127.0.0.1", "--port", str(rtr), "--prefill-policy", policy,
                                       *[a for p, b in prefills for a in ("--prefill", f"http://127.0.0.1:{p},bootstrap_port={b}")],
                                       "--decode", f"http://127.0.0.1:{dec}"])
    url = f"http://127.0.0.1:{rtr}"
    svc.wait_healthy([url + "/health"], 120)
    return url


async def one(url: str, mt: MultiTurnConfig) -> tuple[list[dict], float]:
    """(per-turn rows, hit rate over turns 2..)."""
    cfg = ClientConfig(base_url=url, model="bench", endpoint="chat", timeout_s=600)
    results, rows = await run_multi_turn(cfg, mt, load_tokenizer(None), concurrency=None)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    later = [r for r in results if int(r.tag.removeprefix("turn")) >= 1]
    if any(r.cached_tokens is None for r in later):
        raise RuntimeError("the server reported no prompt_tokens_details.cached_tokens")
    prompt = sum(r.server_prompt_tokens or r.prompt_len for r in later)
    return rows, sum(r.cached_tokens for r in later) / prompt


def main() -> int:
    a = parse()
    mt = MultiTurnConfig(a.conversations, a.turns, a.turn_len, a.output_len, a.system_prompt_len)
    uptime = {"before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    runs: dict[str, list[dict]] = {}
    hit: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as logs, LocalServices(Path(logs)) as svc:
        for policy in POLICIES:
            url = start(svc, policy, a.threads)
            runs[policy], hit[policy] = asyncio.run(one(url, mt))
            print(f"== {policy}: prefix hit rate {hit[policy]:.1%}\n{turn_table(runs[policy])}", flush=True)
            svc.stop_all()
    uptime["after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    ratio = hit["cache_aware"] / hit["round_robin"] if hit["round_robin"] else float("inf")
    doc = {"config": vars(a), "uptime": uptime, "by_turn": runs, "hit_rate": hit, "ratio_cache_aware_over_rr": ratio}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"prefix hit rate, turns 2-{a.turns}: round_robin {hit['round_robin']:.1%}, "
          f"cache_aware {hit['cache_aware']:.1%}, ratio {ratio:.2f}x")
    print(f"uptime before: {uptime['before']}\nuptime after:  {uptime['after']}\nwrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
