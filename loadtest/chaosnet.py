"""Chaos scenarios on the split-node harness: router, 2 prefills and 2 decodes, each in its own network
namespace (loadtest/netns.py, loadtest/splitnode.py), KV over UCX/TCP across veth links.

    python -m loadtest.chaosnet --out out/chaosnet [--scenarios kill-decode,link-down] [--write-doc docs/reliability.md]

1. One cluster for the whole suite (start-up is the expensive part); a reference batch once: --requests
   greedy streams at once (loadtest/chaos.py: completions, chat and /generate in turn, ignore_eos, exact
   length).
2. Per scenario, the same batch again with one fault, on the worker of the scenario's role carrying the
   most requests by its own count (/server_info in_flight), injected as soon as it has any (never after a
   fixed time: loadtest/chaos_trigger.py, bounded by --timeout), "mid-stream" faults once a quarter of
   the tokens also arrived, "mid-prefill" ones at once (its requests in prefill or KV transfer); every worker's
   prefix cache is flushed first (POST /flush_cache), so the batch's prefills are computed again as in the
   reference batch, not served from the cache:
     kill-decode     kill -9 (its process group) a decode mid-stream
     kill-prefill    kill -9 a prefill mid-prefill
     stop-decode     SIGSTOP a decode mid-stream for --stop-s, then SIGCONT
     link-down       `ip link set eth0 down` in a prefill's namespace mid-prefill (its link to the decodes,
                     and to the router), up again after --link-s
     drain-decode    SIGTERM a decode's main process mid-stream (it drains and exits 0)
     oversubscribed  a decode with a KV pool of 1/--oversubscribe of the batch's KV need (admitting
                     greedily: --new-token-ratio 0), the other decode taken out of the router (DELETE
                     /admin/workers), the batch run on it (it must retract to host memory and reload),
                     the other put back. The decode drained by drain-decode is restarted so (else the
                     last decode is, for this scenario).
3. Restarts: there is no `pdserve up` here. After the batch, the harness starts every worker process that
   exited (killed or drained) again in its namespace with the same flags, as a Kubernetes Deployment
   (restartPolicy Always) would, and waits until the router re-admitted it.
4. Checks per scenario (`problems`, empty when all hold): every request completed with the reference
   text (no token lost or repeated; a healthy pair is always left, so no error is allowed); no hang (no
   event for --timeout s); the fault hit requests in flight; every pool back to 0 (kv_used_tokens,
   active_rooms, host KV pages); the next batch completes. Oversubscribed: retractions and reloads > 0.
Report: OUT/chaosnet.json, a markdown table (printed; with --write-doc, replaced in that file between
the chaosnet markers, with the command, date and load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.procs import wait_until
from engine.cpus import threads_per_worker
from engine.models.embedded import resolve_model_path
from loadtest import promtext
from loadtest.chaos import batch, counter, flush_caches, pools_free
from loadtest.chaos_trigger import FaultTrigger, busiest
from loadtest.netns import Netns, NetnsConfig, entered
from loadtest.splitnode import Cluster, SplitNodeConfig

ROLES = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
COUNTERS = ("pdserve_router_migrations_total", "pdserve_router_retries_total")
BEGIN, END = "<!-- chaosnet table: begin -->", "<!-- chaosnet table: end -->"
T0 = time.monotonic()


def say(msg: str) -> None:
    """Progress line: seconds since the suite started."""
    print(f"chaosnet [{time.monotonic() - T0:5.0f} s] {msg}", flush=True)


@dataclass(frozen=True)
class Scenario:
    key: str
    role: str  # the role of the worker the fault hits
    fault: str  # kill | stop | link | term | oversubscribe
    at: str  # "stream": also a quarter of the tokens arrived; "prefill": at once; "": no fault trigger
    what: str  # table text ({stop_s}, {link_s}, {factor} filled in)


SCENARIOS = (
    Scenario("kill-decode", "decode", "kill", "stream", "kill -9 a decode mid-stream"),
    Scenario("kill-prefill", "prefill", "kill", "prefill", "kill -9 a prefill mid-prefill"),
    Scenario("stop-decode", "decode", "stop", "stream", "SIGSTOP a decode mid-stream for {stop_s:g} s"),
    Scenario("link-down", "prefill", "link", "prefill", "a prefill's link down mid-prefill for {link_s:g} s"),
    Scenario("drain-decode", "decode", "term", "stream", "SIGTERM (drain) a decode mid-stream"),
    Scenario("oversubscribed", "decode", "oversubscribe", "", "one decode, its KV pool {factor:.1f}x oversubscribed"),
)
KEYS = tuple(s.key for s in SCENARIOS)


def retraction_counters(metrics: str) -> dict[str, int]:
    """{"retractions", "reloads"} of a decode's /metrics page: the typed counters
    pdserve_worker_{retractions,reloads}_total, else the older gauges pdserve_worker_counters{name=...}."""
    samples = promtext.parse(metrics)
    out = {}
    for k in ("retractions", "reloads"):
        v = promtext.total(samples, f"pdserve_worker_{k}_total")
        out[k] = int(v if not math.isnan(v) else math.fsum(
            x for (n, labels), x in samples.items() if n == "pdserve_worker_counters" and ("name", k) in labels))
    return out


class Harness:
    """The running cluster, seen from the router's namespace (the caller has entered it)."""

    def __init__(self, net: Netns, cluster: Cluster, a: argparse.Namespace) -> None:
        self.net, self.cluster, self.a = net, cluster, a
        self.router = cluster.url["rtr"]
        self.workers = {n: cluster.url[n] for n in ROLES}
        self.reference: list[dict] = []
        self.restarted: list[str] = []  # this scenario's restarts
        self.small_pool_next = False  # the next decode restarted gets the oversubscribed scenario's pool
        self.small_node: str | None = None  # the decode running with that pool

    def batch(self, max_tokens: int, on_progress=None) -> tuple[list[dict], float]:  # noqa: ANN001
        t0 = time.monotonic()
        res = asyncio.run(batch(self.router, self.a.requests, max_tokens, self.a.timeout, on_progress))
        return res, time.monotonic() - t0

    def counters(self) -> dict[str, float]:
        return {c: counter(self.router, c) for c in COUNTERS}

    def info(self, node: str) -> dict:
        return httpx.get(self.workers[node] + "/server_info", timeout=10).json()["internal_states"][0]

    def worker_counters(self, node: str) -> dict[str, int]:
        """node's retractions and reloads so far, from its /metrics (the typed `_total` counters, or the
        older pdserve_worker_counters{name=...} gauges)."""
        return retraction_counters(httpx.get(self.workers[node] + "/metrics", timeout=10).text)

    def restart(self, node: str) -> None:
        """Wait for node's process to end, then start it again (the harness's restart rule); a decode
        with the small pool of the oversubscribed scenario when `small_pool_next` is set."""
        proc = self.cluster.procs[node]
        proc.wait(self.a.timeout)
        extra: tuple[str, ...] = ()
        if self.small_pool_next and self.cluster.roles[node] == "decode":
            extra, self.small_pool_next, self.small_node = small_pool_flags(self), False, node
        say(f"{node} exited ({proc.returncode}); starting it again {' '.join(extra)}")
        self.cluster.spawn_worker(node, extra)
        self.restarted.append(node)

    def restart_exited(self) -> None:
        for n in ROLES:
            if self.cluster.procs[n].poll() is not None:
                self.restart(n)

    def all_healthy(self) -> bool:
        rows = httpx.get(self.router + "/admin/workers", timeout=10).json()["workers"]
        return len(rows) == len(ROLES) and all(w["healthy"] for w in rows)

    def stop_worker(self, node: str) -> None:
        """SIGTERM node's main process (it drains) and wait for it to exit."""
        proc = self.cluster.procs[node]
        os.kill(proc.pid, signal.SIGTERM)
        wait_until(lambda: proc.poll() is not None, self.a.timeout, f"{node} to exit after SIGTERM")


def _inject(h: Harness, sc: Scenario, node: str) -> list[threading.Timer]:
    """The fault on `node`; the timers that undo it (joined after the batch)."""
    pid = h.cluster.procs[node].pid  # `ip netns exec` execs the service: its main process, group leader
    timers: list[threading.Timer] = []
    if sc.fault == "kill":  # and started again at once, as a Deployment would (start-up overlaps the batch)
        os.killpg(pid, signal.SIGKILL)
        h.restart(node)
    elif sc.fault == "term":
        os.kill(pid, signal.SIGTERM)  # the main process only, as Kubernetes sends it: the service drains
    elif sc.fault == "stop":
        os.killpg(pid, signal.SIGSTOP)
        timers.append(threading.Timer(h.a.stop_s, os.killpg, (pid, signal.SIGCONT)))
    elif sc.fault == "link":
        h.net.set_link(node, False)
        timers.append(threading.Timer(h.a.link_s, h.net.set_link, (node, True)))
    for t in timers:
        t.start()
    return timers


def _faulted_batch(h: Harness, sc: Scenario) -> tuple[list[dict], float, dict]:
    """The batch with the scenario's fault, injected once its role's busiest worker has requests in
    flight (by its own /server_info), mid-stream faults only after a quarter of the tokens arrived."""
    at = h.a.requests * h.a.max_tokens // 4 if sc.at == "stream" else 0
    candidates = {n: u for n, u in h.workers.items() if ROLES[n] == sc.role}
    timers: list[threading.Timer] = []
    flush_caches(h.workers, timeout=h.a.timeout)
    trigger = FaultTrigger(f"a {sc.role} with requests in flight (its /server_info in_flight > 0)",
                           lambda: busiest(candidates), lambda node: timers.extend(_inject(h, sc, node)),
                           h.a.timeout, at_tokens=at).start()
    try:
        res, secs = h.batch(h.a.max_tokens, trigger.on_progress)
    finally:
        hit = trigger.stop()
    for t in timers:
        t.join()
    return res, secs, hit


def small_pool_flags(h: Harness) -> tuple[str, ...]:
    """Flags of a decode whose KV pool is 1/--oversubscribe of the reference batch's KV need (whole pages
    of prompt + output, rounded down), at least one request's worth, admitting greedily (retraction does the rest)."""
    ps = h.cluster.cfg.page_size
    pages = [math.ceil((r["prompt_tokens"] + h.a.max_tokens) / ps) for r in h.reference]
    usable = max(int(sum(pages) // h.a.oversubscribe), max(pages))
    return "--max-total-tokens", str(usable * ps), "--new-token-ratio", "0"


def _oversubscribed_batch(h: Harness, sc: Scenario) -> tuple[list[dict], float, dict]:
    """The batch on one decode with a small pool (the one the drain scenario restarted so, else the last
    decode, restarted now), the other decodes out of the router for it."""
    node = h.small_node
    if node is None:
        node = h.cluster.nodes("decode")[-1]
        h.stop_worker(node)
        h.cluster.spawn_worker(node, small_pool_flags(h))  # the last flag wins
        wait_until(h.all_healthy, h.a.ready_timeout, f"{node} re-admitted with a small pool", interval=0.5)
    others = [n for n in h.cluster.nodes("decode") if n != node]
    for n in others:
        httpx.delete(h.router + "/admin/workers", params={"url": h.workers[n]}, timeout=10).raise_for_status()
    before, pool_tokens = h.worker_counters(node), h.info(node)["kv_total_tokens"]
    try:
        res, secs = h.batch(h.a.max_tokens)
    finally:
        for n in others:
            httpx.post(h.router + "/admin/workers", json={"url": h.workers[n], "role": "decode"}, timeout=30)
    after = h.worker_counters(node)
    ps = h.cluster.cfg.page_size
    need = sum(math.ceil((r["prompt_tokens"] + h.a.max_tokens) / ps) for r in h.reference)
    hit = {"node": node, "in_flight": len(res), "need_pages": need, "pool_pages": pool_tokens // ps,
           **{k: after[k] - before[k] for k in ("retractions", "reloads")}}
    return res, secs, hit


def run_scenario(h: Harness, sc: Scenario) -> dict:
    say(f"{sc.key} ...")
    h.restarted = []
    before = h.counters()
    res, secs, hit = (_oversubscribed_batch if sc.fault == "oversubscribe" else _faulted_batch)(h, sc)
    moved = {c: int(v - before[c]) for c, v in h.counters().items()}
    problems = []
    if sc.fault == "term" and "node" in hit:
        proc = h.cluster.procs[hit["node"]]
        wait_until(lambda: proc.poll() is not None, h.a.timeout, "the drained decode to exit", interval=0.2)
        if proc.returncode != 0:
            problems.append(f"drained {hit['node']} exited {proc.returncode}, not 0")
    h.restart_exited()
    try:
        wait_until(lambda: pools_free(h.workers), h.a.timeout, "pools back to 0", interval=0.5)
        pools = "0"
    except TimeoutError:
        pools = "not 0: " + json.dumps({n: _pool(h.info(n)) for n in ROLES})
        problems.append(f"pools after: {pools}")
    wait_until(h.all_healthy, h.a.ready_timeout, "every worker healthy in the router", interval=0.5)
    nxt, _ = h.batch(4)
    ref = {r["i"]: r["text"] for r in h.reference}
    row = {
        "scenario": sc.key, "what": sc.what.format(stop_s=h.a.stop_s, link_s=h.a.link_s,
                                                   factor=hit.get("need_pages", 0) / hit.get("pool_pages", 1)),
        "requests": len(res), "completed": sum(r["status"] == "ok" for r in res),
        "equal_to_unfailed": sum(r["status"] == "ok" and r["text"] == ref[r["i"]] for r in res),
        "migrated": moved[COUNTERS[0]], "retried": moved[COUNTERS[1]],
        "clean_errors": sum(r["status"] == "error" for r in res), "hangs": sum(r["status"] == "hang" for r in res),
        "pools_after": pools, "hit": hit, "restarted": h.restarted,
        "next_batch_ok": sum(r["status"] == "ok" for r in nxt),
        "batch_s": round(secs, 1), "errors": [r["error"] for r in res if r["error"]][:5],
    }
    problems += _problems(row, sc)
    row["problems"] = problems
    say(f"{sc.key}: {json.dumps({k: row[k] for k in ('completed', 'equal_to_unfailed', 'migrated', 'retried', 'hangs', 'batch_s', 'problems')})}")  # noqa: E501
    return row


def _pool(st: dict) -> dict:
    return {k: st.get(k) for k in ("kv_used_tokens", "active_rooms", "host_kv_used_pages")}


def _problems(row: dict, sc: Scenario) -> list[str]:
    out = []
    n = row["requests"]
    if row["equal_to_unfailed"] != n:
        out.append(f"{n - row['equal_to_unfailed']} of {n} requests did not end with the unfailed text")
    if row["hangs"]:
        out.append(f"{row['hangs']} requests hung")
    if not row["hit"].get("in_flight"):
        out.append(f"the fault hit no request in flight: {row['hit'].get('error') or row['hit']}")
    if sc.fault == "oversubscribe" and not (row["hit"]["retractions"] and row["hit"]["reloads"]):
        out.append(f"no retraction and reload under oversubscription: {row['hit']}")
    if row["next_batch_ok"] != n:
        out.append(f"next batch: {row['next_batch_ok']} of {n} completed")
    return out


def run(a: argparse.Namespace) -> dict:
    global T0
    T0 = t0 = time.monotonic()
    scenarios = [s for s in SCENARIOS if s.key in a.scenarios]
    cfg = SplitNodeConfig(out_dir=a.out, prefix=a.prefix, ready_timeout_s=a.ready_timeout,
                          service_args=("--threads", str(threads_per_worker(len(ROLES))), "--max-total-tokens",
                                        str(a.max_total_tokens)))
    with Netns(NetnsConfig(prefix=a.prefix, nodes=("rtr", *ROLES))) as net:
        cluster = Cluster(net, cfg, resolve_model_path(""), roles=dict(ROLES))
        cluster.start()
        startup_s = time.monotonic() - t0
        say(f"cluster up in {startup_s:.0f} s")
        with entered(net.cfg.ns("rtr")):
            h = Harness(net, cluster, a)
            h.reference, ref_s = h.batch(a.max_tokens)
            bad = [r for r in h.reference if r["status"] != "ok"]
            if bad:
                raise RuntimeError(f"the reference batch failed: {bad[:3]}")
            say(f"reference batch in {ref_s:.0f} s")
            rows = []
            for sc in scenarios:  # the drained decode comes back with the small pool: one start-up less
                h.small_pool_next = sc.key == "drain-decode" and "oversubscribed" in a.scenarios
                rows.append(run_scenario(h, sc))
    report = {"rows": rows, "startup_s": round(startup_s, 1), "reference_s": round(ref_s, 1),
              "total_s": round(time.monotonic() - t0, 1), "requests": a.requests, "max_tokens": a.max_tokens,
              "problems": [f"{r['scenario']}: {p}" for r in rows for p in r["problems"]]}
    Path(a.out, "chaosnet.json").write_text(json.dumps(report, indent=1))
    return report


def table(report: dict) -> str:
    lines = ["| scenario | requests | completed | equal to unfailed | migrated | retried | clean errors | hangs "
             "| pools after | next batch |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        extra = ""
        if "need_pages" in r["hit"]:
            extra = (f" ({r['hit']['need_pages']} pages needed, {r['hit']['pool_pages']} in the pool; "
                     f"{r['hit']['retractions']} retractions, {r['hit']['reloads']} reloads)")
        elif "in_flight" in r["hit"]:
            extra = f" ({r['hit']['in_flight']} requests on it)"
        lines.append(f"| {r['what']}{extra} | {r['requests']} | {r['completed']} | {r['equal_to_unfailed']} | "
                     f"{r['migrated']} | {r['retried']} | {r['clean_errors']} | {r['hangs']} | {r['pools_after']} | "
                     f"{r['next_batch_ok']}/{r['requests']} |")
    return "\n".join(lines)


def write_doc(path: Path, report: dict, command: str) -> None:
    """Replace the text between the chaosnet markers of `path` with the table and how it was measured."""
    load = re.sub(r"^.*load average", "load average", os.popen("uptime").read().strip())
    block = (f"{BEGIN}\n{table(report)}\n\nMeasured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} with\n\n"
             f"    {command}\n\nin {report['total_s']:.0f} s (cluster start-up {report['startup_s']:.0f} s, "
             f"reference batch {report['reference_s']:.0f} s); `uptime` after: {load}.\n{END}")
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path} has no chaosnet markers ({BEGIN} ... {END})")
    path.write_text(text[: text.index(BEGIN)] + block + text[text.index(END) + len(END):])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.chaosnet", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output directory (chaosnet.json, logs/)")
    p.add_argument("--scenarios", default=",".join(KEYS), type=lambda s: s.split(","),
                   help=f"comma-separated, run in this order whatever the order given: {','.join(KEYS)}")
    p.add_argument("--requests", type=int, default=8, help="concurrent streaming requests per batch")
    p.add_argument("--max-tokens", type=int, default=16, help="exact output length of each request")
    p.add_argument("--stop-s", type=float, default=25.0, help="seconds a SIGSTOPped decode stays frozen")
    p.add_argument("--link-s", type=float, default=10.0, help="seconds a prefill's link stays down")
    p.add_argument("--oversubscribe", type=float, default=4.0, help="the batch's KV need / the decode's KV pool")
    p.add_argument("--max-total-tokens", type=int, default=2048, help="KV pool of every worker, in tokens")
    p.add_argument("--timeout", type=float, default=90.0,
                   help="seconds without an event after which a request counts as hung; also bounds each wait")
    p.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a (re)started worker may take")
    p.add_argument("--prefix", default="pdc", help="namespace name prefix (at most 8 alphanumerics)")
    p.add_argument("--write-doc", default="", help="markdown file whose chaosnet table is replaced")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    unknown = set(a.scenarios) - set(KEYS)
    if unknown:
        p.error(f"unknown scenarios {sorted(unknown)}; choose from {','.join(KEYS)}")
    if a.requests < 1 or a.max_tokens < 4 or a.oversubscribe < 1:
        p.error("--requests must be >= 1, --max-tokens >= 4, --oversubscribe >= 1")
    report = run(a)
    print(table(report))
    if a.write_doc:
        cmd = "python -m loadtest.chaosnet " + " ".join(argv if argv is not None else sys.argv[1:])
        write_doc(Path(a.write_doc), report, cmd)
    print(json.dumps({k: report[k] for k in ("total_s", "startup_s", "problems")}, indent=1))
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
