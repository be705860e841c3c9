"""Issue 53's overload cases against real stacks: what each answers and how fast (docs/reliability.md,
"Overload").

    python benchmarks/overload_cases.py [--tree DIR] [--out FILE]

Each case starts its own stack from `--tree` (default this checkout; another tree, e.g. a `git
worktree` of an older commit, shows the before), sends its requests (`/generate` with `input_ids`,
greedy, ignore_eos; embedded model on the CPU) and records status, seconds, finish reason or error,
tokens and Retry-After. A request with no answer within `--limit` seconds is recorded as "no answer".

  pool_colocated  pdserve colocated --max-total-tokens 500: a 290-token prompt with max_new_tokens 220
                  (more than the pool), then a 600-token prompt (larger than the pool)
  pool_pd         the same through pdserve up --decode-args "--max-total-tokens 500"
  busy_decode     pdserve up --decode-args "--max-running-requests 1 --max-queued-requests 1": four
                  291-token prompts (PD) of 200, 32, 32, 32 tokens sent 0.3 s apart: the first runs, the
                  second queues, the others are refused (503 + Retry-After) by a healthy, busy decode
Prints one line per request and writes JSON with the load average at the start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.procs import free_port  # noqa: E402

PROMPT = [1000 + (7 * i) % 3000 for i in range(290)]
CASES = {
    "pool_colocated": (["colocated", "--max-total-tokens", "500"], [(PROMPT, 220), (PROMPT * 2 + PROMPT[:20], 8)]),
    "pool_pd": (["up", "--decode-args", "--max-total-tokens 500"], [(PROMPT, 220), (PROMPT * 2 + PROMPT[:20], 8)]),
    "busy_decode": (["up", "--decode-args", "--max-running-requests 1 --max-queued-requests 1"],
                    [([2000 + i, *PROMPT], n) for i, n in enumerate((200, 32, 32, 32))]),
}


async def _one(c: httpx.AsyncClient, url: str, ids: list[int], n: int, limit: float) -> dict:
    t0 = time.monotonic()
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    try:
        r = await c.post(url + "/generate", json=body, timeout=limit)
    except httpx.TimeoutException:
        return {"prompt": len(ids), "max_new_tokens": n, "status": "no answer", "seconds": limit}
    b = r.json()
    answer = b["meta_info"]["finish_reason"] if "meta_info" in b else b.get("error")
    return {"prompt": len(ids), "max_new_tokens": n, "status": r.status_code,
            "seconds": round(time.monotonic() - t0, 2), "answer": answer, "tokens": len(b.get("output_ids", [])),
            "retry_after": r.headers.get("retry-after")}


async def _send(url: str, reqs: list[tuple[list[int], int]], together: bool, limit: float) -> list[dict]:
    async with httpx.AsyncClient() as c:
        if not together:
            return [await _one(c, url, ids, n, limit) for ids, n in reqs]
        tasks = []
        for ids, n in reqs:
            tasks.append(asyncio.create_task(_one(c, url, ids, n, limit)))
            await asyncio.sleep(0.3)  # arrival order is the point of the case
        return list(await asyncio.gather(*tasks))


def _metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(("pdserve_router_worker_busy_total", "pdserve_router_retries_total",
                            "pdserve_worker_pool_truncated_total")):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def run_case(name: str, tree: Path, limit: float) -> dict:
    cmd, reqs = CASES[name]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    extra = ["--grace", "3"] if cmd[0] == "up" else ["--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", *cmd, "--port", str(port), *extra], cwd=tree, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the stack did not start")
            time.sleep(0.5)
        if cmd[0] == "up":  # the router answers /health once one worker per role is; wait for its probes
            time.sleep(3)
        results = asyncio.run(_send(url, reqs, name == "busy_decode", limit))
        return {"case": name, "flags": cmd, "requests": results, "metrics": _metrics(url)}
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", type=Path, default=ROOT, help="source tree whose pdserve runs (default: this checkout)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)} (default all)")
    p.add_argument("--limit", type=float, default=240, help="seconds a request may take before it is recorded as "
                   "'no answer' (default 240)")
    p.add_argument("--out", default="docs/bench/overload_cases.json", help="JSON output")
    a = p.parse_args()
    report = {"load_average_at_start": os.getloadavg()[0], "tree": str(a.tree), "cases": []}
    for name in a.cases.split(","):
        case = run_case(name, a.tree.resolve(), a.limit)
        report["cases"].append(case)
        for r in case["requests"]:
            print(f"{name}: prompt {r['prompt']} max_new {r['max_new_tokens']} -> {r['status']} in {r['seconds']} s "
                  f"{json.dumps(r.get('answer'))} tokens {r.get('tokens')} retry-after {r.get('retry_after')}")
        print(f"{name}: {case['metrics']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
