"""Prefill routing and the prefills' prefix caches: round_robin vs cache_aware with the approximate index
vs cache_aware with KV events (issues 14 and 52), in PD behind the router.

One run starts N prefills and one decode (local processes) and, for each prefill count of --prefills
(the first k prefills) and each routing of --routings, a fresh router in front of them:

  round_robin          --prefill-policy round_robin
  cache_aware_approx   --prefill-policy cache_aware --kv-events off   (the approximate prefix tree)
  cache_aware_events   --prefill-policy cache_aware --kv-events auto  (the index the prefills' KV events
                       build; the prefills publish with --kv-events-endpoint tcp://127.0.0.1:*, as in
                       tests/integration/test_router_kv_events.py; docs/kv_events.md)

Before each run every worker's prefix cache is flushed (POST /flush_cache), so each run starts cold
(--fresh-workers restarts them instead). The prefills publish all along, so a new events router's first
batch from a prefill that served an earlier run is a sequence gap: the router replays it from 0, or
clears that prefill's entries when its replay buffer moved on; either way the index is right (the
cache was flushed), and /admin/kv_index, kept in the JSON, counts it. The decode prefills nothing itself
(--local-prefill-threshold 0).

Workloads (--workload):
- tokens (default; issue 52): multi-turn conversations as SGLang /generate requests with `input_ids`,
  which the router hashes into the prefills' block hashes. Every conversation starts with one shared
  system prefix (--system-prompt-len random token ids); turn k+1's ids = turn k's ids + its output_ids
  + --turn-len new user ids. The conversations run at once, each sending its next turn when the reply
  to the last one is in (starts --stagger s apart, --think-time between turns, --concurrency caps the
  requests in flight). The prefills' KV pools are small (--max-total-tokens) so that they evict under
  the workload: that is where the approximate index, which never learns of evictions, guesses wrong.
- chat (issue 14's original comparison): loadtest/multiturn.py's lockstep chat conversations. The router
  tokenizes the messages as the prefills' frontends do (router/prompt_ids.py, the tokenizer the prefills
  report in /server_info), so cache_aware_events scores them by the KV index too; each events run waits
  for that tokenizer before it starts, and its /admin/kv_index (kept in the JSON) counts the prompts it
  tokenized. The old figures (docs/benchmarks.md, "Prefix-aware routing, PD") came from
      --workload chat --prefills 2 --routings round_robin,cache_aware_approx --max-total-tokens 0

Figures per (prefills, routing): prefix hit rate = cached prompt tokens / prompt tokens over turns 2..
(each answer's meta_info.cached_tokens, /generate; usage.prompt_tokens_details.cached_tokens, chat: the
prefill's hit), TTFT p50 (client side, streamed: send to the first token) over turns 2.. and over all
turns, the prefills' evicted prefix tokens (pdserve_worker_prefix_evicted_tokens_total), the requests
each prefill got, and with events the router's /admin/kv_index (predicted vs reported cached tokens).
Then per prefill count the ratios cache_aware_events / cache_aware_approx, printed beside issue 52's
aim: with 4 prefills, under evictions, a hit rate at least 1.2x the approximate index's.

    python benchmarks/cache_aware_routing.py --prefills 2,4 --out docs/bench/cache_aware_routing_kv_events.json

Smoke test: --prefills 2 --conversations 3 --turns 3.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.procs import free_port, stop_all  # noqa: E402
from loadtest import promtext  # noqa: E402
from loadtest.client import ClientConfig  # noqa: E402
from loadtest.metrics import RequestResult  # noqa: E402
from loadtest.multiturn import MultiTurnConfig, run_multi_turn, turn_row, turn_table  # noqa: E402
from loadtest.services import ALWAYS_PD, LocalServices  # noqa: E402
from loadtest.workload import load_tokenizer  # noqa: E402

# routing name -> (router --prefill-policy, router --kv-events)
ROUTINGS = {
    "round_robin": ("round_robin", "off"),
    "cache_aware_approx": ("cache_aware", "off"),
    "cache_aware_events": ("cache_aware", "auto"),
}
EVENTS = ["--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*"]
AIM_PREFILLS, AIM_RATIO = 4, 1.2  # issue 52: events >= 1.2x the approximate index's hit rate with 4 prefills
# per workload: (conversations, turns, turn_len, output_len, system_prompt_len, prefill --max-total-tokens)
DEFAULTS = {"tokens": (24, 6, 128, 16, 256, 3072), "chat": (5, 6, 100, 16, 32, 0)}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("tokens", "chat"), default="tokens",
                   help="tokens: /generate with input_ids, conversations at once (default); chat: the old lockstep "
                        "chat comparison (loadtest/multiturn.py)")
    w.add_argument("--conversations", type=int, default=None, help="conversations (default: 24 tokens, 5 chat)")
    w.add_argument("--turns", type=int, default=None, help="turns per conversation (default: 6)")
    w.add_argument("--turn-len", type=int, default=None,
                   help="tokens of each new user message (default: 128 tokens, 100 chat)")
    w.add_argument("--output-len", type=int, default=None, help="tokens of each reply (default: 16)")
    w.add_argument("--system-prompt-len", type=int, default=None,
                   help="tokens of the system prefix every conversation shares (default: 256 tokens, 32 chat)")
    w.add_argument("--concurrency", type=int, default=0,
                   help="tokens workload: max requests in flight (default 0: one per conversation)")
    w.add_argument("--stagger", type=float, default=0.5,
                   help="tokens workload: seconds between the starts of two conversations (default 0.5)")
    w.add_argument("--think-time", type=float, default=0.0,
                   help="tokens workload: seconds a conversation waits between a reply and its next turn "
                        "(default 0)")
    w.add_argument("--seed", type=int, default=0, help="seed of the token ids / prompts (default 0)")
    w.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    s = p.add_argument_group("stack")
    s.add_argument("--prefills", default="2,4",
                   help="comma-separated prefill counts to compare, each behind one router and one decode "
                        "(default 2,4); the largest count of prefills is started, smaller counts use the first k")
    s.add_argument("--routings", default=None,
                   help=f"comma-separated routings out of {', '.join(ROUTINGS)} (default: all three)")
    s.add_argument("--max-total-tokens", type=int, default=None,
                   help="each prefill's device KV pool in tokens: small, so that the prefills evict under the "
                        "workload (default: 3072 tokens; 0 chat = the worker's default)")
    s.add_argument("--decode-max-total-tokens", type=int, default=32768,
                   help="the decode's KV pool in tokens (default 32768; 0: the worker's default)")
    s.add_argument("--page-size", type=int, default=0, help="the workers' --page-size (default 0: theirs, 16)")
    s.add_argument("--model", default="", help="the workers' --model (default: the embedded SmolLM2-135M)")
    s.add_argument("--device", default="cpu", help="the workers' --device (default cpu)")
    s.add_argument("--threads", type=int, default=1, help="torch threads of each worker (default 1)")
    s.add_argument("--cache-threshold", type=float, default=None,
                   help="the router's --cache-threshold (default: the router's, 0.3)")
    s.add_argument("--fresh-workers", action="store_true",
                   help="restart the workers for every run instead of flushing their caches between runs")
    s.add_argument("--logs", default="",
                   help="directory for the services' logs, kept (default: a temporary one, deleted)")
    s.add_argument("--out", default="cache_aware_routing.json", help="JSON output file (written after every run)")
    a = p.parse_args(argv)
    d = dict(zip(("conversations", "turns", "turn_len", "output_len", "system_prompt_len", "max_total_tokens"),
                 DEFAULTS[a.workload]))
    for k, v in d.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.routings is None:
        a.routings = ",".join(ROUTINGS)
    a.prefill_counts = sorted({int(x) for x in a.prefills.split(",") if x.strip()})
    a.routing_list = [r.strip() for r in a.routings.split(",") if r.strip()]
    bad = [r for r in a.routing_list if r not in ROUTINGS]
    if bad or not a.routing_list:
        p.error(f"--routings: unknown {bad}; choose from {', '.join(ROUTINGS)}")
    if not a.prefill_counts or a.prefill_counts[0] < 1:
        p.error("--prefills: counts must be >= 1")
    if a.conversations < 1 or a.turns < 1 or a.turn_len < 1 or a.output_len < 1 or a.system_prompt_len < 0:
        p.error("--conversations, --turns, --turn-len, --output-len must be >= 1, --system-prompt-len >= 0")
    longest = a.system_prompt_len + a.turns * (a.turn_len + a.output_len)
    if a.max_total_tokens and longest + a.output_len > a.max_total_tokens:
        p.error(f"--max-total-tokens {a.max_total_tokens} cannot hold the last turn's prompt (~{longest} tokens)")
    return a


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- the stack ---------------------------------------------------------------------------------------
class Stack:
    """`n` prefills publishing KV events and one decode, started once; a router per run in front of the
    first k prefills."""

    def __init__(self, svc: LocalServices, a: argparse.Namespace, n: int) -> None:
        self.svc, self.a, self.n = svc, a, n
        self.prefills: list[tuple[str, int]] = []  # (url, bootstrap port)
        self.decode = ""
        self.router = ""
        self.runs = 0

    def _worker_args(self) -> list[str]:
        a = self.a
        args = ["--host", "127.0.0.1", "--device", a.device, "--threads", str(a.threads)]
        if a.model:
            args += ["--model", a.model]
        if a.page_size:
            args += ["--page-size", str(a.page_size)]
        return args

    def start_workers(self) -> None:
        py, common = [sys.executable, "-m", "pdserve"], self._worker_args()
        self.runs += 1
        pool = ["--max-total-tokens", str(self.a.max_total_tokens)] if self.a.max_total_tokens else []
        self.prefills = []
        for i in range(self.n):
            port, boot = free_port(), free_port()
            self.svc.spawn(f"prefill{i}-{self.runs}", py + ["prefill", *common, *pool, *EVENTS, "--port", str(port),
                                                            "--bootstrap-port", str(boot)])
            self.prefills.append((f"http://127.0.0.1:{port}", boot))
        dec = free_port()
        dpool = ["--max-total-tokens", str(self.a.decode_max_total_tokens)] if self.a.decode_max_total_tokens else []
        self.svc.spawn(f"decode-{self.runs}", py + ["decode", *common, *dpool, "--port", str(dec), *ALWAYS_PD])
        self.decode = f"http://127.0.0.1:{dec}"
        log(f"starting {self.n} prefill(s) (KV pool {self.a.max_total_tokens or 'default'} tokens, KV events on) "
            f"and 1 decode")
        self.svc.wait_healthy([u + "/health" for u, _ in self.prefills] + [self.decode + "/health"], 900)
        log("workers healthy")

    def stop_workers(self) -> None:
        self.stop_router()
        stop_all([self.svc.procs.pop(n) for n in list(self.svc.procs)], 10.0)

    def flush(self) -> None:
        """Empty every worker's prefix cache (retried while a worker still holds a finished request)."""
        for url in [u for u, _ in self.prefills] + [self.decode]:
            deadline = time.monotonic() + 120
            while True:
                r = httpx.post(url + "/flush_cache", timeout=30)
                if r.status_code == 200:
                    break
                if r.status_code != 409 or time.monotonic() > deadline:
                    raise RuntimeError(f"POST {url}/flush_cache: {r.status_code} {r.text[:200]}")
                time.sleep(0.5)

    def start_router(self, k: int, routing: str) -> str:
        policy, kv_events = ROUTINGS[routing]
        rtr = free_port()
        args = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", str(rtr),
                "--prefill-policy", policy, "--kv-events", kv_events,
                *[x for u, b in self.prefills[:k] for x in ("--prefill", f"{u},bootstrap_port={b}")],
                "--decode", self.decode]
        if self.a.cache_threshold is not None:
            args += ["--cache-threshold", str(self.a.cache_threshold)]
        self.router = f"http://127.0.0.1:{rtr}"
        self.svc.spawn(f"router-{k}p-{routing}", args)
        self.svc.wait_healthy([self.router + "/health"], 120)
        want = {u for u, _ in self.prefills[:k]}
        _wait(lambda: want | {self.decode} <= {w["url"] for w in _get(self.router + "/admin/workers")["workers"]
                                                if w["eligible"]}, 60, "the router admitting every worker")
        if kv_events == "auto":
            _wait(lambda: want <= set(_get(self.router + "/admin/kv_index")["workers"]), 60,
                  "the router subscribing to every prefill's KV events")
            if self.a.workload == "chat":  # text prompts: routed by the index once the router has the tokenizer
                _wait(lambda: (_get(self.router + "/admin/kv_index").get("tokenizer") or {}).get("state")
                      in ("ready", "failed"), 120, "the router loading the prefills' tokenizer")
                tok = _get(self.router + "/admin/kv_index")["tokenizer"]
                if tok["state"] != "ready":
                    raise RuntimeError(f"the router could not load the tokenizer: {tok}")
            time.sleep(1.0)  # zmq's slow joiner: the SUBs' subscriptions reach the PUBs
        return self.router

    def stop_router(self) -> None:
        names = [n for n in self.svc.procs if n.startswith("router-")]
        stop_all([self.svc.procs.pop(n) for n in names], 10.0)
        self.router = ""

    def prefill_counters(self, k: int) -> list[dict[str, float]]:
        """Per prefill (the first k): evicted and hit prefix tokens, requests (counters since start)."""
        out = []
        for url, _ in self.prefills[:k]:
            m = promtext.parse(httpx.get(url + "/metrics", timeout=10).text)
            out.append({"evicted_tokens": _num(promtext.total(m, "pdserve_worker_prefix_evicted_tokens_total")),
                        "hit_tokens": _num(promtext.total(m, "pdserve_worker_prefix_hit_tokens_total")),
                        "requests": _num(promtext.total(m, "pdserve_requests_total"))})
        return out


def _num(v: float) -> float:
    return 0.0 if v != v else v  # NaN (no such sample) -> 0


def _get(url: str) -> dict:
    r = httpx.get(url, timeout=10)
    r.raise_for_status()
    return r.json()


def _wait(cond, timeout_s: float, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if cond():
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


# ---- the token-id workload ------------------------------------------------------------------------------
class TokenSource:
    """Random token ids of the model's vocabulary (its added/special tokens left out)."""

    def __init__(self, model: str) -> None:
        tok = load_tokenizer(model or None)
        special = set(tok.get_added_tokens_decoder())
        self.ids = [i for i in range(tok.get_vocab_size()) if i not in special]

    def take(self, rng: random.Random, n: int) -> list[int]:
        return [rng.choice(self.ids) for _ in range(n)]


async def generate(client: httpx.AsyncClient, url: str, ids: list[int], a: argparse.Namespace, index: int,
                   tag: str, t0: float) -> tuple[RequestResult, list[int]]:
    """One streamed /generate; (result, output ids). Never raises for HTTP or protocol failures."""
    res = RequestResult(index=index, prompt_len=len(ids), output_len=a.output_len, start=time.monotonic() - t0,
                        tag=tag)
    out: list[int] = []
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": a.output_len, "temperature": 0, "ignore_eos": True}}
    try:
        async with client.stream("POST", url + "/generate", json=body, timeout=a.timeout) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return res, out
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = f"stream error: {json.dumps(ev['error'])[:300]}"
                    return res, out
                got = ev.get("output_ids") or []  # cumulative
                if len(got) > len(out):
                    res.chunk_times.append(time.monotonic() - t0)
                    out = list(got)
                meta = ev.get("meta_info") or {}
                if meta.get("finish_reason"):
                    res.cached_tokens = meta.get("cached_tokens")
                    res.server_prompt_tokens = meta.get("prompt_tokens")
                    res.output_tokens = int(meta.get("completion_tokens") or len(out))
        if not res.chunk_times:
            res.error = "stream ended without any token"
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    finally:
        res.end = time.monotonic() - t0
    return res, out


async def run_tokens(url: str, a: argparse.Namespace, source: TokenSource, label: str) -> list[RequestResult]:
    """Every turn of every conversation; results in completion order (tag "turnK", K from 0)."""
    system = source.take(random.Random(a.seed), a.system_prompt_len)
    total = a.conversations * a.turns
    results: list[RequestResult] = []
    failed: list[RequestResult] = []
    gate = asyncio.Semaphore(a.concurrency) if a.concurrency > 0 else None
    every = max(1, total // 10)
    t0 = time.monotonic()
    limits = httpx.Limits(max_connections=a.conversations + 8, max_keepalive_connections=a.conversations + 8)

    async def conversation(c: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(a.seed * 1_000_003 + c + 1)  # the same user turns whatever the routing
        ids = list(system)
        await asyncio.sleep(c * a.stagger)
        for turn in range(a.turns):
            if turn and a.think_time:
                await asyncio.sleep(a.think_time)
            ids = ids + source.take(rng, a.turn_len)
            if gate is not None:
                async with gate:
                    res, out = await generate(client, url, ids, a, len(results), f"turn{turn}", t0)
            else:
                res, out = await generate(client, url, ids, a, len(results), f"turn{turn}", t0)
            results.append(res)
            if len(results) % every == 0 or len(results) == total:
                log(f"  [{label}] {len(results)}/{total} requests, {time.monotonic() - t0:.1f} s")
            if not res.ok:
                failed.append(res)
                return  # the conversation cannot go on without its reply
            ids = ids + out

    async with httpx.AsyncClient(limits=limits, timeout=a.timeout) as client:
        await asyncio.gather(*(conversation(c, client) for c in range(a.conversations)))
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {[r.error for r in failed[:3]]}")
    return results


async def run_chat(url: str, a: argparse.Namespace, label: str) -> list[RequestResult]:
    mt = MultiTurnConfig(a.conversations, a.turns, a.turn_len, a.output_len, a.system_prompt_len, a.seed)
    cfg = ClientConfig(base_url=url, model="bench", endpoint="chat", timeout_s=a.timeout)
    results, _ = await run_multi_turn(cfg, mt, load_tokenizer(a.model or None), concurrency=None)
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:3]}")
    log(f"  [{label}] {len(results)} requests")
    return results


# ---- figures -------------------------------------------------------------------------------------------
def summarize(results: list[RequestResult], turns: int) -> dict:
    def turn_of(r: RequestResult) -> int:
        return int(r.tag.removeprefix("turn"))

    later = [r for r in results if turn_of(r) >= 1]
    if any(r.cached_tokens is None for r in later):
        raise RuntimeError("the server reported no cached_tokens (meta_info / usage)")
    prompt = sum(r.server_prompt_tokens or r.prompt_len for r in later)
    cached = sum(r.cached_tokens for r in later)
    ttft_later = [r.ttft for r in later if r.ttft is not None]
    ttft_all = [r.ttft for r in results if r.ttft is not None]
    return {
        "requests": len(results),
        "hit_rate": cached / prompt if prompt else None,
        "cached_tokens_later": cached, "prompt_tokens_later": prompt,
        "ttft_p50_s": float(np.percentile(ttft_later, 50)) if ttft_later else None,
        "ttft_p90_s": float(np.percentile(ttft_later, 90)) if ttft_later else None,
        "ttft_p50_all_turns_s": float(np.percentile(ttft_all, 50)) if ttft_all else None,
        "by_turn": [turn_row(t, [r for r in results if turn_of(r) == t], None) for t in range(turns)],
    }


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else (num / den if den else float("inf"))


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def comparisons(runs: dict[str, dict[str, dict]]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for k, by in runs.items():
        rr, ap, ev = (by.get(r) for r in ROUTINGS)
        c: dict[str, float | None] = {}
        if ap and ev:
            c["hit_rate_events_over_approx"] = ratio(ev["hit_rate"], ap["hit_rate"])
            c["ttft_p50_events_over_approx"] = ratio(ev["ttft_p50_s"], ap["ttft_p50_s"])
        if rr and ap:
            c["hit_rate_approx_over_round_robin"] = ratio(ap["hit_rate"], rr["hit_rate"])
        if rr and ev:
            c["hit_rate_events_over_round_robin"] = ratio(ev["hit_rate"], rr["hit_rate"])
        out[k] = c
    return out


def aim(runs: dict[str, dict[str, dict]], comp: dict[str, dict]) -> dict:
    k = str(AIM_PREFILLS)
    r = comp.get(k, {}).get("hit_rate_events_over_approx")
    evicted = sum(runs.get(k, {}).get("cache_aware_approx", {}).get("prefill_evicted_tokens", []) or [0])
    return {"text": f"issue 52: with {AIM_PREFILLS} prefills under evictions, the hit rate with KV events "
                    f">= {AIM_RATIO}x the approximate index's",
            "ratio": r, "evictions_in_approx_run": evicted,
            "met": None if r is None else bool(r >= AIM_RATIO and evicted > 0)}


def table(runs: dict[str, dict[str, dict]], comp: dict[str, dict], turns: int) -> str:
    lines = [f"{'prefills':>8}  {'routing':<20}{'hit rate':>9}{'TTFT p50 2..':>14}{'TTFT p50 all':>14}"
             f"{'evicted tok':>13}  requests per prefill",
             f"{'':>8}  {'':<20}{'turns 2-' + str(turns):>9}{'ms':>14}{'ms':>14}"]
    for k, by in runs.items():
        for routing, r in by.items():
            lines.append(f"{k:>8}  {routing:<20}{fmt(r['hit_rate'] and 100 * r['hit_rate'], '.1f') + '%':>9}"
                         f"{fmt(r['ttft_p50_s'] and 1000 * r['ttft_p50_s'], '.0f'):>14}"
                         f"{fmt(r['ttft_p50_all_turns_s'] and 1000 * r['ttft_p50_all_turns_s'], '.0f'):>14}"
                         f"{sum(r['prefill_evicted_tokens']):>13.0f}  "
                         f"{' '.join(str(int(x)) for x in r['prefill_requests'])}")
        c = comp.get(k, {})
        if c:
            parts = []
            if "hit_rate_events_over_approx" in c:
                parts.append(f"events/approx: hit rate {fmt(c['hit_rate_events_over_approx'], '.2f')}x, "
                             f"TTFT p50 {fmt(c['ttft_p50_events_over_approx'], '.2f')}x")
            for key, what in (("hit_rate_approx_over_round_robin", "approx/round_robin"),
                              ("hit_rate_events_over_round_robin", "events/round_robin")):
                if key in c:
                    parts.append(f"{what} hit rate {fmt(c[key], '.2f')}x")
            lines.append(f"{'':>8}  " + "; ".join(parts))
    return "\n".join(lines)


def one_run(stack: Stack, a: argparse.Namespace, source: TokenSource | None, k: int, routing: str) -> dict:
    """The workload once through a fresh router in front of the first k prefills; its figures."""
    label = f"{k} prefills, {routing}"
    url = stack.start_router(k, routing)
    log(f"== {label}: router {url} (--prefill-policy {ROUTINGS[routing][0]} --kv-events {ROUTINGS[routing][1]})")
    before = stack.prefill_counters(k)
    t0 = time.monotonic()
    if source is not None:
        results = asyncio.run(run_tokens(url, a, source, label))
    else:
        results = asyncio.run(run_chat(url, a, label))
    wall = time.monotonic() - t0
    time.sleep(0.5)  # the prefills' last counters and events
    after = stack.prefill_counters(k)
    r = summarize(results, a.turns)
    r["wall_s"] = wall
    for key in ("evicted_tokens", "hit_tokens", "requests"):
        r[f"prefill_{key}"] = [y[key] - x[key] for x, y in zip(before, after)]
    if ROUTINGS[routing][1] == "auto":
        r["kv_index"] = _get(url + "/admin/kv_index")
    stack.stop_router()
    log(f"== {label}: prefix hit rate {fmt(r['hit_rate'] and 100 * r['hit_rate'], '.1f')}%, "
        f"TTFT p50 turns 2.. {fmt(r['ttft_p50_s'] and 1000 * r['ttft_p50_s'], '.0f')} ms, "
        f"evicted {sum(r['prefill_evicted_tokens']):.0f} prefix tokens, {wall:.1f} s\n{turn_table(r['by_turn'])}")
    if "kv_index" in r:
        ws = r["kv_index"].get("workers", {})
        pred = sum(w["predicted_cached_tokens"] for w in ws.values())
        rep = sum(w["reported_cached_tokens"] for w in ws.values())
        n = {f: sum(w[f] for w in ws.values()) for f in ("gaps", "replays", "stale_clears", "restarts")}
        why = " (expected: one per prefill that served an earlier run)" if n["gaps"] else ""
        tok = r["kv_index"].get("tokenizer") or {}
        log(f"   KV index: predicted cached tokens {pred}, reported {rep}; gaps {n['gaps']} (replays "
            f"{n['replays']}, stale clears {n['stale_clears']}){why}, restarts {n['restarts']}; prompts the router "
            f"tokenized {tok.get('tokenized', 0)}")
    return r


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    uptime = {"before": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    log(f"workload {a.workload}: {a.conversations} conversations x {a.turns} turns, system {a.system_prompt_len}, "
        f"turn {a.turn_len}, reply {a.output_len} tokens; prefills {a.prefill_counts}; routings {a.routing_list}")
    source = TokenSource(a.model) if a.workload == "tokens" else None
    runs: dict[str, dict[str, dict]] = {}
    doc: dict = {"config": dict(vars(a)), "uptime": uptime, "runs": runs}
    logs_ctx = tempfile.TemporaryDirectory() if not a.logs else None
    log_dir = Path(a.logs or logs_ctx.name)
    try:
        with LocalServices(log_dir) as svc:
            stack = Stack(svc, a, max(a.prefill_counts))
            if not a.fresh_workers:
                stack.start_workers()
            for k in a.prefill_counts:
                for routing in a.routing_list:
                    if a.fresh_workers:
                        stack.start_workers()
                    else:
                        stack.flush()
                    runs.setdefault(str(k), {})[routing] = one_run(stack, a, source, k, routing)
                    if a.fresh_workers:
                        stack.stop_workers()
                    doc["comparisons"] = comparisons(runs)
                    _write(a.out, doc)
    finally:
        if logs_ctx is not None:
            logs_ctx.cleanup()
    uptime["after"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    comp = doc["comparisons"] = comparisons(runs)
    doc["aim"] = aim(runs, comp) if a.workload == "tokens" else None
    _write(a.out, doc)
    print(table(runs, comp, a.turns))
    if doc["aim"] is not None:
        m = doc["aim"]
        verdict = ("not measured (needs --prefills with 4 and both cache_aware routings)" if m["ratio"] is None
                   else f"{m['ratio']:.2f}x: {'met' if m['met'] else 'not met'}"
                   + ("" if m["evictions_in_approx_run"] else " (no evictions: lower --max-total-tokens)"))
        print(f"aim ({m['text']}): {verdict}")
    for k, by in runs.items():
        if not any(sum(r["prefill_evicted_tokens"]) for r in by.values()) and a.workload == "tokens":
            print(f"note: with {k} prefills no prefill evicted anything; lower --max-total-tokens or add conversations")
    print(f"uptime before: {uptime['before']}\nuptime after:  {uptime['after']}\nwrote {a.out}")
    return 0


def _write(path: str, doc: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
