"""Chaos scenarios on a local `pdserve up` cluster: kill -9 a worker under load.

    python -m loadtest.chaos --out out/chaos [--kill decode|prefill --requests 12 --max-tokens 32]

1. `pdserve up --prefill P --decode D` (supervised: --restart on-failure), logs in OUT/logs.
2. Reference batch: `--requests` greedy streams at once (completions, chat and /generate in turn,
   distinct prompts, exact length: ignore_eos), all must complete.
3. Chaos batch: the same requests again, the fault fired on a condition read from the victim, never after
   a fixed time (loadtest/chaos_trigger.py): the worker of the role with the most requests in flight by
   its own /server_info, as soon as it has any (within --timeout, else the run reports what it waited
   for). `--kill decode`: once a quarter of the expected tokens have also arrived, that decode is killed
   mid-stream (SIGKILL to its process group). `--kill prefill`: that prefill is killed mid-prefill (its
   requests in prefill, waiting or in KV transfer). `--signal STOP` freezes it for --stop-s instead,
   `--signal TERM` drains it (it exits 0 and stays down).
4. Checks per request: completed with the reference text (no token lost or repeated), a clean error
   (an error event), or a hang (no end within --timeout). Migrations from the router's counter; the
   killed decode must be restarted by `pdserve up`; every pool back to 0; the next batch completes.
Report: OUT/chaos.json and one table row (markdown) printed, for docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from common.http import TOKEN_HEADER
from common.procs import free_port, wait_until
from loadtest import promtext
from loadtest.chaos_trigger import FaultTrigger, busiest
from loadtest.services import ALWAYS_PD

REPO = Path(__file__).resolve().parent.parent
SIGNALS = {"KILL": signal.SIGKILL, "STOP": signal.SIGSTOP, "TERM": signal.SIGTERM}
WHAT = {"KILL": "kill -9", "STOP": "SIGSTOP (then SIGCONT)", "TERM": "SIGTERM (drain)"}


def request_body(i: int, max_tokens: int) -> tuple[str, dict]:
    common = {"model": "x", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    topic = ["a lighthouse", "the Roman empire", "a cat", "rivers", "bread", "the moon"][i % 6] + f" #{i}"
    if i % 3 == 1:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"Tell me about {topic}."}]}
    if i % 3 == 2:  # native: cumulative text and output_ids in each event
        sampling = {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        return "/generate", {"text": f"Some facts about {topic}:", "sampling_params": sampling, "stream": True}
    return "/v1/completions", {**common, "prompt": f"A short essay on {topic}:"}


async def _one(c: httpx.AsyncClient, url: str, i: int, max_tokens: int, progress: list[int]) -> dict:
    path, body = request_body(i, max_tokens)
    text, error, prompt_tokens, ids = "", "", 0, []
    try:
        async with c.stream("POST", url + path, json=body) as r:
            if r.status_code != 200:
                return {"i": i, "status": "error", "error": (await r.aread()).decode()[:200], "text": ""}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    error = ev["error"].get("message", "")
                    continue
                if "meta_info" in ev:  # /generate
                    progress[0] += len(ev["output_ids"]) - len(ids)
                    text, ids, prompt_tokens = ev["text"], ev["output_ids"], ev["meta_info"]["prompt_tokens"]
                    continue
                prompt_tokens = (ev.get("usage") or {}).get("prompt_tokens") or prompt_tokens
                for ch in ev.get("choices") or []:
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if piece:
                        text += piece
                        progress[0] += 1
    except httpx.TimeoutException:
        return {"i": i, "status": "hang", "error": "timeout", "text": text}
    return {"i": i, "status": "error" if error else "ok", "error": error, "text": text, "prompt_tokens": prompt_tokens}


async def batch(url: str, n: int, max_tokens: int, timeout: float, on_progress=None) -> list[dict]:  # noqa: ANN001
    progress = [0]
    async with httpx.AsyncClient(timeout=timeout) as c:
        tasks = [asyncio.ensure_future(_one(c, url, i, max_tokens, progress)) for i in range(n)]
        while not all(t.done() for t in tasks):
            if on_progress is not None:
                on_progress(progress[0])
            await asyncio.sleep(0.05)
        return [t.result() for t in tasks]


class _Up:
    def __init__(self, out: Path, prefills: int, decodes: int, port: int) -> None:
        self.log_dir = out / "logs"
        argv = [sys.executable, "-m", "pdserve", "up", "--prefill", str(prefills), "--decode", str(decodes), "--port",
                str(port), "--log-dir", str(self.log_dir), "--max-total-tokens", "8192",
                "--decode-args", " ".join(ALWAYS_PD)]  # faults mid-prefill need every prompt on a prefill
        self.proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()

    def text(self) -> str:
        return "".join(self.lines)

    def workers(self) -> dict[str, str]:
        """name -> url of every worker, from `started NAME pid N: URL`."""
        return dict(re.findall(r"started ((?:prefill|decode)-\d+) pid \d+: (\S+)", self.text()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def pools_free(workers: dict[str, str], token: str = "") -> bool:
    """Every worker's kv_used_tokens, active_rooms and host KV pages are 0 (token: the internal one, if any)."""
    headers = {TOKEN_HEADER: token} if token else {}
    for url in workers.values():
        try:
            st = httpx.get(url + "/server_info", headers=headers, timeout=5).json()["internal_states"][0]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            return False
        if st["kv_used_tokens"] or st.get("active_rooms", 0) or st.get("host_kv_used_pages", 0):
            return False
    return True


def flush_caches(workers: dict[str, str], token: str = "", timeout: float = 120.0) -> None:
    """Empty every worker's prefix cache (POST /flush_cache, retried while it answers 409 busy), so the
    next batch computes its prefills as the cold reference batch did and a mid-prefill fault meets
    prefills in flight instead of cache hits."""
    headers = {TOKEN_HEADER: token} if token else {}

    def flushed(url: str) -> bool:
        try:
            return httpx.post(url + "/flush_cache", headers=headers, timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    for name, url in workers.items():
        wait_until(lambda u=url: flushed(u), timeout, f"{name}'s prefix cache flushed", interval=0.2)


def counter(router: str, name: str) -> float:
    return promtext.total(promtext.parse(httpx.get(router + "/metrics").text), name)


def _chaos_batch(a: argparse.Namespace, up: _Up, router: str, workers: dict[str, str],
                 token: str) -> tuple[list[dict], dict]:
    """The batch again, with a.signal sent to the a.kill worker with the most requests in flight (by its own
    /server_info), as soon as it has any; a decode only after a quarter of the expected tokens arrived.
    Returns the results and the trigger's hit ({"node", "in_flight"} or {"error"})."""
    candidates = {n: u for n, u in workers.items() if n.startswith(a.kill)}

    def inject(name: str) -> None:
        pid = int(re.search(rf"started {name} pid (\d+)", up.text()).group(1))
        # TERM goes to the service's main process only, as Kubernetes sends it: the service drains
        (os.kill if a.signal == "TERM" else os.killpg)(pid, SIGNALS[a.signal])
        if a.signal == "STOP":  # frozen for --stop-s, then thawed (the scenario, not a wait)
            threading.Timer(a.stop_s, os.killpg, (pid, signal.SIGCONT)).start()

    trigger = FaultTrigger(f"a {a.kill} with requests in flight (its /server_info in_flight > 0)",
                           lambda: busiest(candidates, token), inject, a.timeout,
                           at_tokens=a.requests * a.max_tokens // 4 if a.kill == "decode" else 0).start()
    try:
        res = asyncio.run(batch(router, a.requests, a.max_tokens, a.timeout, trigger.on_progress))
    finally:
        hit = trigger.stop()
    return res, hit


def run(a: argparse.Namespace) -> dict:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    router = f"http://127.0.0.1:{port}"
    up = _Up(out, a.prefill, a.decode, port)
    try:
        wait_until(lambda: "Ctrl-C stops everything" in up.text() or up.proc.poll() is not None, 900, "pdserve up")
        token = (up.log_dir / "internal-token").read_text().strip()
        workers = up.workers()
        t0 = time.monotonic()
        ref = asyncio.run(batch(router, a.requests, a.max_tokens, a.timeout))
        ref_s = time.monotonic() - t0
        assert all(r["status"] == "ok" for r in ref), [r for r in ref if r["status"] != "ok"]
        before = {c: counter(router, c) for c in ("pdserve_router_migrations_total", "pdserve_router_retries_total")}
        flush_caches(workers, token)
        t0 = time.monotonic()
        res, hit = _chaos_batch(a, up, router, workers, token)
        chaos_s = time.monotonic() - t0
        after = {c: counter(router, c) - v for c, v in before.items()}
        same = sum(r["status"] == "ok" and r["text"] == ref[r["i"]]["text"] for r in res)
        killed = [hit["node"]] if "node" in hit else []
        (out / "batches.json").write_text(json.dumps({"reference": ref, "chaos": res, "killed": killed, "hit": hit},
                                                             indent=1))
        restarted = (a.signal == "KILL" and bool(killed)
                     and wait_until(lambda: f"restarted {killed[0]}" in up.text(), 120, "restart"))
        gone = set(killed) if a.signal == "TERM" else set()
        wait_until(lambda: pools_free({n: u for n, u in up.workers().items() if n not in gone}, token), 120,
                   "pools back to 0")
        if a.signal != "TERM":  # a drained worker exits 0 and stays down (--restart on-failure)
            wait_until(lambda: all(w["healthy"] for w in httpx.get(router + "/admin/workers").json()["workers"]),
                       600, "the worker re-admitted")
        nxt = asyncio.run(batch(router, a.requests, 4, a.timeout))
        report = {
            "scenario": f"{WHAT[a.signal]} a {a.kill} mid-{'stream' if a.kill == 'decode' else 'prefill'} "
                        f"({a.prefill} prefill, {a.decode} decode)", "requests": a.requests,
            "completed": sum(r["status"] == "ok" for r in res), "equal_to_unfailed": same,
            "migrated": int(after["pdserve_router_migrations_total"]),
            "retried": int(after["pdserve_router_retries_total"]),
            "victim_in_flight": [hit["in_flight"]] if killed else [],
            "clean_errors": sum(r["status"] == "error" for r in res),
            "hangs": sum(r["status"] == "hang" for r in res), "pools_after": "0", "killed": killed,
            "fault": hit.get("error", "injected"),
            "restarted": restarted, "next_batch_ok": sum(r["status"] == "ok" for r in nxt),
            "reference_s": round(ref_s, 1), "chaos_s": round(chaos_s, 1),
            "errors": [r["error"] for r in res if r["error"]][:5],
        }
        (out / "chaos.json").write_text(json.dumps(report, indent=2))
        return report
    finally:
        up.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (chaos.json, logs/)")
    p.add_argument("--requests", type=int, default=12, help="concurrent streaming requests per batch")
    p.add_argument("--max-tokens", type=int, default=32, help="exact output length of each request")
    p.add_argument("--kill", choices=("decode", "prefill"), default="decode", help="the role of the worker killed")
    p.add_argument("--signal", choices=tuple(SIGNALS), default="KILL",
                   help="KILL (restarted by pdserve up), STOP (SIGCONT after --stop-s), TERM (drains, exits 0)")
    p.add_argument("--stop-s", type=float, default=25.0, help="seconds a SIGSTOPped worker stays frozen")
    p.add_argument("--prefill", type=int, default=1, help="prefill services")
    p.add_argument("--decode", type=int, default=2, help="decode services")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds after which a request counts as hung")
    r = run(p.parse_args(argv))
    print(json.dumps(r, indent=2))
    print("| scenario | requests | completed | equal to unfailed | migrated | retried | clean errors | hangs | "
          "pools after |")
    print(f"| {r['scenario']} | {r['requests']} | {r['completed']} | {r['equal_to_unfailed']} | {r['migrated']} | "
          f"{r['retried']} | {r['clean_errors']} | {r['hangs']} | {r['pools_after']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
