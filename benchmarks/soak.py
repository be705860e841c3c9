"""Soak (issue 53): `pdserve up` under a mixed workload for a long time. Is every request answered, does
none hang, is every process's RSS flat after warm-up?

The stack: this script starts `python -m pdserve up` itself (every word after `--` is passed to it, e.g.
a decode with a small KV pool and few running requests so the bursts overfill it; logs in a new temp
dir), or `--url` targets a running one (RSS then comes from `--pids` and their process trees, or is not
read; the workers' /server_info from `--internal-token-file`).

The workload, for `--duration` seconds: `--concurrency` clients, each sending one request after another,
its kind drawn by `--mix` weights:

  stream_chat     streaming chat, content as a list of text parts, stream_options.include_usage
  chat_n          non-streamed chat, n 2-3, logprobs with top_logprobs 2
  chat_json       chat with response_format json_schema (a stop must carry valid JSON)
  generate        SGLang-style /generate, streamed or not
  hangup_stream   a streaming chat the client closes after `--hangup-after` events
  client_timeout  a long chat whose client gives up after `--client-timeout` s

and beside them, on their own clocks (the first at half a period): every `--big-every` s a prompt
larger than the decode's KV pool (kind too_big: a 400 is expected, quickly), every `--over-pool-every` s
a prompt of a quarter of the pool with max_tokens of the whole pool, ignore_eos (kind over_pool: prompt +
output exceed the pool: a 200 with finish_reason length or a clear 4xx are expected), and every
`--burst-every` s `--burst-factor` x `--concurrency` streaming chats of `--burst-tokens` tokens at once
(kind burst), which overfill a small decode.

Every request is classified: ok, expected_4xx (a 4xx where one is expected), overload_503 (a 503 with
Retry-After, as a header or the error body's retry_after), other_error (status and a message sample kept),
hung (no answer within `--hang-limit` s), client_hangup (the client closed it on purpose). An error
event inside a 200 stream counts by its own code.

Every `--sample-every` s one line is printed and one sample kept: RSS of every process of the stack
(the process tree of `pdserve up` read from /proc, each named by its role: router, prefill-0, its
worker prefill-0/worker, ...), the counts so far, the router's /metrics (requests by status, retries,
migrations, ejections) and each worker's /server_info (in flight, KV used/total, queues, running
requests, active rooms, and the counters retractions, pool_truncated, watchdog_ended, queue_rejected,
queue_timed_out, rooms_kept_queued where the worker has them). After the run, once the last request is
answered, a final sample once the workers are idle (in flight and active rooms back to 0, waited for up
to 60 s); the report's drained_after says whether they got there with no KV in use.

Verdict: hung == 0, every request answered, and per process the RSS growth from the first sample at or
after warm-up to the last. Warm-up lasts `--warmup` s (default min(300 s, a quarter of the run)) and, unless
--no-warmup-through-retraction, until the first sample in which a worker has retracted (its first retraction
commits host KV pool pages on first touch: a one-time step bounded by the pool; the growth from `--warmup`
alone is reported beside it, as rss_from_timed_warmup). "flat" when it is at most
max(--flat-mb, --flat-pct % of the first), else "growing"; "restarted" when the process's pid changed
after warm-up; "gone" when it vanished. pass = hung == 0 and all answered and every process flat.
Prints a closing table (RSS per process, counts by class, latency p50/p99 per kind) and writes `--out`.

    python benchmarks/soak.py --duration 3600 -- --decode-args '--max-total-tokens 2048 --max-running-requests 2'
    python benchmarks/soak.py --duration 240 --sample-every 30 --burst-every 60 --over-pool-every 100 \\
        --out /tmp/soak.json -- --decode-args '--max-total-tokens 2048 --max-running-requests 2'
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pids UP_PID \\
        --internal-token-file /tmp/pdserve-up-XXXX/internal-token
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.http import TOKEN_HEADER  # noqa: E402
from common.procs import free_port  # noqa: E402

CLASSES = ("ok", "expected_4xx", "overload_503", "other_error", "hung", "client_hangup")
KINDS = ("stream_chat", "chat_n", "chat_json", "generate", "hangup_stream", "client_timeout")
DEFAULT_MIX = "stream_chat=4,chat_n=2,chat_json=2,generate=2,hangup_stream=1,client_timeout=1"
WORKER_COUNTERS = ("retractions", "pool_truncated", "watchdog_ended", "queue_rejected", "queue_timed_out",
                   "rooms_kept_queued")
WORDS = ["river", "stone", "light", "garden", "signal", "winter", "copper", "harbor", "orbit", "meadow"]  # ~1 token
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer"}}, "required": ["name", "age"]}


# ---------------------------------------------------------------------------------------------------------
# processes and RSS (Linux /proc)

def proc_table(proc: Path = Path("/proc")) -> dict[int, tuple[int, list[str]]]:
    """pid -> (ppid, argv) of every process now (those that vanish while read are left out)."""
    out: dict[int, tuple[int, list[str]]] = {}
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out[int(d.name)] = (ppid, [a.decode(errors="replace") for a in argv if a])
    return out


def descendants(table: Mapping[int, tuple[int, list[str]]], roots: list[int]) -> list[int]:
    """`roots` (those alive) and all their descendants, parents before children."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [r for r in roots if r in table]
    while todo:
        pid = todo.pop(0)
        if pid not in out:
            out.append(pid)
            todo += sorted(children.get(pid, []))
    return out


def rss_mb(pid: int, proc: Path = Path("/proc")) -> float | None:
    """VmRSS of `pid` in MB (None: gone, or a kernel thread)."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def short_name(argv: list[str]) -> str:
    """A process's role from its command line: a service role (with its port), a multiprocessing child, or
    the program's name."""
    text = " ".join(argv)
    if "multiprocessing.resource_tracker" in text:
        return "resource_tracker"
    if "multiprocessing.spawn" in text or "--multiprocessing-fork" in argv:
        return "worker"
    if "-m" in argv and argv.index("-m") + 1 < len(argv):
        i = argv.index("-m") + 1
        mod = argv[i]
        role = argv[i + 1] if mod == "pdserve" and i + 1 < len(argv) else mod
        if "--port" in argv and argv.index("--port") + 1 < len(argv):
            role += ":" + argv[argv.index("--port") + 1]
        return role
    return Path(argv[0]).name if argv else "?"


def name_processes(table: Mapping[int, tuple[int, list[str]]], pids: list[int],
                   known: Mapping[int, str]) -> dict[int, str]:
    """A stable name per pid: `known` names (e.g. from `pdserve up`'s "started NAME pid P" lines), else the
    parent's name + "/" + short_name(argv) (a root: short_name alone); siblings of the same name get
    "#2", "#3" in pid order. `pids` parents first (descendants())."""
    names: dict[int, str] = {}
    used: Counter[str] = Counter()
    for pid in pids:
        if pid in known:
            name = known[pid]
        else:
            ppid, argv = table[pid]
            base = short_name(argv)
            name = f"{names[ppid]}/{base}" if ppid in names else base
        used[name] += 1
        names[pid] = name if used[name] == 1 else f"{name}#{used[name]}"
    return names


def read_rss(roots: list[int], known: Mapping[int, str] | None = None) -> dict[str, dict[str, Any]]:
    """{name: {"pid", "rss_mb"}} for every process in the trees of `roots`."""
    table = proc_table()
    pids = descendants(table, roots)
    names = name_processes(table, pids, known or {})
    out = {}
    for pid in pids:
        mb = rss_mb(pid)
        if mb is not None:
            out[names[pid]] = {"pid": pid, "rss_mb": round(mb, 1)}
    return out


# ---------------------------------------------------------------------------------------------------------
# classification, growth, verdict (pure)

def error_of(body: Any) -> dict[str, Any]:
    """The `error` object of an error body or event ({} when there is none)."""
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return err
        if isinstance(err, str):
            return {"message": err}
        if "detail" in body and not body.get("choices"):  # a framework's own error shape
            return {"message": str(body["detail"])}
    return {}


def retry_after(headers: Mapping[str, str] | None, body: Any) -> str | None:
    if headers:
        for k, v in headers.items():
            if k.lower() == "retry-after":
                return str(v)
    ra = error_of(body).get("retry_after")
    return str(ra) if ra else None


def classify(status: int, headers: Mapping[str, str] | None, body: Any, expect_4xx: bool = False,
             problem: str = "") -> tuple[str, str]:
    """(class, detail) of one answered request. `status`: the HTTP status; `body`: its parsed JSON (an error
    object), or the error event that ended a 200 stream; `problem`: why a 200 answer failed its kind's check
    ("" when it passed). A 200 carrying an error counts by the error's code (none: other_error)."""
    err = error_of(body)
    msg = str(err.get("message", "") or (body if isinstance(body, str) else ""))[:300]
    if status == 200:
        if not err and not problem:
            return "ok", ""
        code = err.get("code")
        if not isinstance(code, int) or code == 200:
            return "other_error", f"200: {problem or msg}"[:300]
        status = code
    if status == 503 and (ra := retry_after(headers, body)) is not None:
        return "overload_503", f"503 retry-after {ra}: {msg}"[:300]
    if 400 <= status < 500 and expect_4xx:
        return "expected_4xx", f"{status}: {msg}"[:300]
    return "other_error", f"{status}: {msg}"[:300]


def pct(values: list[float], q: float) -> float | None:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


def growth(series: list[dict[str, Any]], warmup_s: float, run_end_t: float, flat_mb: float,
           flat_pct: float) -> dict[str, Any]:
    """RSS growth of one process from its first sample at or after `warmup_s` to its last. `series`: samples
    {"t", "rss_mb", "pid"}; `run_end_t`: the t of the run's last sample (a process whose last sample is
    earlier has gone). call: flat (growth <= max(flat_mb, flat_pct % of the first)), growing, restarted
    (another pid after warm-up), gone, or too_short (fewer than 2 samples after warm-up)."""
    post = [s for s in series if s["t"] >= warmup_s]
    out: dict[str, Any] = {"samples_after_warmup": len(post)}
    if series:
        out["max_mb"] = max(s["rss_mb"] for s in series)
    if len(post) < 2:
        out["call"] = "too_short"
        return out
    first, last = post[0]["rss_mb"], post[-1]["rss_mb"]
    g = last - first
    n = len(post)
    mt = sum(s["t"] for s in post) / n
    mr = sum(s["rss_mb"] for s in post) / n
    var = sum((s["t"] - mt) ** 2 for s in post)
    slope = sum((s["t"] - mt) * (s["rss_mb"] - mr) for s in post) / var if var else 0.0
    limit = max(flat_mb, flat_pct / 100 * first)
    out.update(first_mb=first, last_mb=last, max_after_warmup_mb=max(s["rss_mb"] for s in post),
               growth_mb=round(g, 1), growth_pct=round(100 * g / first, 2) if first else None,
               slope_mb_per_h=round(slope * 3600, 1), limit_mb=round(limit, 1))
    if len({s["pid"] for s in post}) > 1:
        out["call"] = "restarted"
    elif post[-1]["t"] < run_end_t:
        out["call"] = "gone"
    else:
        out["call"] = "growing" if g > limit else "flat"
    return out


def verdict(counts: Mapping[str, int], sent: int, rss: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """hung == 0, every request sent answered (classified and not hung), every process's RSS flat
    (None when RSS was not read or the run was too short to tell)."""
    answered = sum(v for k, v in counts.items() if k != "hung")
    calls = {name: g.get("call") for name, g in rss.items()}
    if not calls or any(c == "too_short" for c in calls.values()):
        rss_flat = None
    else:
        rss_flat = all(c == "flat" for c in calls.values())
    hung = counts.get("hung", 0)
    out = {"hung": hung, "sent": sent, "answered": answered, "all_answered": hung == 0 and answered == sent,
           "other_error": counts.get("other_error", 0), "rss_flat": rss_flat,
           "rss_not_flat": sorted(n for n, c in calls.items() if c != "flat")}
    out["pass"] = bool(hung == 0 and out["all_answered"] and rss_flat is True)
    return out


def prom_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of each sample line of a Prometheus text page."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)', line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        try:
            out.append((m.group(1), labels, float(m.group(4))))
        except ValueError:
            continue
    return out


def router_numbers(text: str) -> dict[str, Any]:
    """The router's /metrics worth watching: requests by status, retries, migrations, ejections."""
    by_status: Counter[str] = Counter()
    out: dict[str, Any] = {"retries": 0, "migrations": 0, "ejections": 0}
    for name, labels, v in prom_samples(text):
        if name == "pdserve_router_requests_total":
            by_status[labels.get("status", "?")] += int(v)
        elif name == "pdserve_router_retries_total":
            out["retries"] += int(v)
        elif name == "pdserve_router_migrations_total":
            out["migrations"] += int(v)
        elif name == "pdserve_router_ejections_total":
            out["ejections"] += int(v)
    out["requests_by_status"] = dict(sorted(by_status.items()))
    return out


def worker_numbers(info: Mapping[str, Any]) -> dict[str, Any]:
    """A worker's /server_info worth watching."""
    st = (info.get("internal_states") or [{}])[0]
    out: dict[str, Any] = {"in_flight": info.get("in_flight"), "worker_pid": info.get("worker_pid"),
                           "kv_used": st.get("kv_used_tokens"), "kv_total": st.get("kv_total_tokens"),
                           "queues": st.get("queues")}
    for k in ("running_requests", "active_rooms", "host_kv_used_pages"):
        if st.get(k) is not None:
            out[k] = st[k]
    counters = st.get("counters") or {}
    out["counters"] = {k: counters[k] for k in WORKER_COUNTERS if k in counters}
    return out


# ---------------------------------------------------------------------------------------------------------
# the stack

class UpStack:
    """`python -m pdserve up` started here, its output read by a thread (names by pid, restarts)."""

    def __init__(self, up_args: list[str], log_dir: Path, startup_timeout: float) -> None:
        self.log_dir = log_dir
        self.port = free_port()
        argv = [sys.executable, "-m", "pdserve", "up", "--port", str(self.port), "--log-dir", str(log_dir),
                "--grace", "10", *up_args]
        self.argv = argv
        self.names: dict[int, str] = {}
        self.events: list[str] = []
        self.ready = threading.Event()
        self.log = open(log_dir / "up.log", "a")
        # its own session: a Ctrl-C here ends the load first and stops the stack after the last answer
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.names[self.proc.pid] = "up"
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + startup_timeout
        while not self.ready.wait(0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pdserve up did not come up (see {log_dir}/up.log):\n"
                                   + "".join(self._tail()))
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = (log_dir / "internal-token").read_text().strip()

    def _tail(self) -> list[str]:
        try:
            return (self.log_dir / "up.log").read_text().splitlines(keepends=True)[-30:]
        except OSError:
            return []

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            if m := re.match(r"started (\S+) pid (\d+):", line):
                self.names[int(m.group(2))] = m.group(1)
            elif m := re.search(r"restarted (\S+) .*: pid (\d+)", line):
                self.names[int(m.group(2))] = m.group(1)
                self.events.append(line.strip())
            elif "exited with" in line or "SIGKILL" in line:
                self.events.append(line.strip())
            if "Ctrl-C stops everything" in line:
                self.ready.set()

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def log_problems(log_dir: Path | None) -> dict[str, dict[str, int]]:
    """Per log file of the stack: lines with ERROR, Traceback, WARNING."""
    out: dict[str, dict[str, int]] = {}
    if log_dir is None or not log_dir.is_dir():
        return out
    for f in sorted(log_dir.glob("*.log")):
        c = Counter()
        for line in f.read_text(errors="replace").splitlines():
            for word in ("ERROR", "Traceback", "WARNING"):
                if word in line:
                    c[word] += 1
        out[f.name] = dict(c)
    return out


# ---------------------------------------------------------------------------------------------------------
# the workload

@dataclass
class Record:
    kind: str
    cls: str
    status: int
    t: float  # seconds since the start, when sent
    latency_s: float
    ttft_s: float | None = None
    detail: str = ""


@dataclass
class Soak:
    a: argparse.Namespace
    url: str
    model: str
    pool_tokens: int
    context_length: int
    headers: dict[str, str]
    rng: random.Random
    t0: float = 0.0
    records: list[Record] = field(default_factory=list)
    counts: Counter = field(default_factory=Counter)
    sent: int = 0
    inflight: set = field(default_factory=set)
    seq: int = 0
    client: Any = None  # httpx.AsyncClient, set by run()
    end: float = 0.0  # when the load stops (monotonic); a first Ctrl-C / SIGTERM moves it to now
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    def stop_early(self) -> None:
        """First Ctrl-C / SIGTERM: stop sending, wait for the answers, report. A second one: stop at once."""
        if self.stopped.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            return
        print(f"  [{time.monotonic() - self.t0:7.0f}s] stopping early: no new requests; waiting for "
              f"{len(self.inflight)} in flight (again to stop at once)", flush=True)
        self.end = min(self.end, time.monotonic())
        self.stopped.set()

    async def nap(self, seconds: float) -> None:
        """Sleep `seconds`, or less if the run is stopped early."""
        try:
            await asyncio.wait_for(self.stopped.wait(), max(0.0, seconds))
        except asyncio.TimeoutError:
            pass

    # bodies ---------------------------------------------------------------------------------------------
    def text(self, words: int) -> str:
        self.seq += 1
        return f"{self.seq} " + " ".join(self.rng.choice(WORDS) for _ in range(words))

    def chat(self, content: Any, max_tokens: int, **extra: Any) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                **extra}

    # one request ----------------------------------------------------------------------------------------
    def launch(self, kind: str) -> asyncio.Task:
        task = asyncio.ensure_future(self.one(kind))
        self.inflight.add(task)
        task.add_done_callback(self.inflight.discard)
        return task

    async def one(self, kind: str) -> None:
        self.sent += 1
        t = time.monotonic()
        ttft: list[float] = []
        try:
            cls, status, detail = await asyncio.wait_for(self._send(kind, t, ttft), self.a.hang_limit)
        except asyncio.TimeoutError:
            cls, status, detail = "hung", 0, f"no answer within {self.a.hang_limit:g} s"
        except httpx.TimeoutException as e:  # a transport timeout past the hang limit's margin
            cls, status, detail = "hung", 0, f"{type(e).__name__}: {e}"
        except httpx.HTTPError as e:
            cls, status, detail = "other_error", 0, f"{type(e).__name__}: {e}"[:300]
        except Exception as e:  # noqa: BLE001 - a bug here must not stop the soak; it is counted and shown
            cls, status, detail = "other_error", 0, f"client {type(e).__name__}: {e}"[:300]
        rec = Record(kind, cls, status, round(t - self.t0, 2), time.monotonic() - t,
                     ttft[0] - t if ttft else None, detail)
        self.records.append(rec)
        self.counts[cls] += 1
        if cls in ("other_error", "hung"):
            print(f"  [{rec.t:7.0f}s] {kind}: {cls} {detail}", flush=True)

    async def _send(self, kind: str, t: float, ttft: list[float]) -> tuple[str, int, str]:
        c = self.client
        mt = self.a.max_tokens
        if kind in ("stream_chat", "burst", "hangup_stream"):
            n_tokens = self.a.burst_tokens if kind == "burst" else (4 * mt if kind == "hangup_stream" else mt)
            parts = [{"type": "text", "text": self.text(self.rng.randint(8, 120))},
                     {"type": "text", "text": "Tell me more."}]
            body = self.chat(parts, n_tokens, stream=True, stream_options={"include_usage": True},
                             temperature=0.7, ignore_eos=kind != "stream_chat")
            stop_after = self.a.hangup_after if kind == "hangup_stream" else 0
            return await self._stream(c, "/v1/chat/completions", body, ttft, stop_after, chat=True)
        if kind == "generate":
            body = {"text": self.text(self.rng.randint(8, 120)), "stream": self.rng.random() < 0.5,
                    "sampling_params": {"max_new_tokens": mt, "temperature": 0.7}}
            if body["stream"]:
                return await self._stream(c, "/generate", body, ttft, 0, chat=False)
            r = await c.post(self.url + "/generate", json=body, headers=self.headers)
            data = _json(r)
            return self._result(r, data, "" if isinstance(data, dict) and "text" in data else "no text")
        if kind == "chat_n":
            n = self.rng.choice([2, 3])
            body = self.chat(self.text(self.rng.randint(8, 80)), max(4, mt // 3), n=n, logprobs=True,
                             top_logprobs=2, temperature=0.8)
            r = await c.post(self.url + "/v1/chat/completions", json=body, headers=self.headers)
            data = _json(r)
            return self._result(r, data, _check_n(data, n))
        if kind == "chat_json":
            body = self.chat(f"{self.text(self.rng.randint(4, 30))}. Describe a person as JSON.", 2 * mt,
                             response_format={"type": "json_schema",
                                              "json_schema": {"name": "person", "schema": SCHEMA}},
                             temperature=0.7)
            r = await c.post(self.url + "/v1/chat/completions", json=body, headers=self.headers)
            data = _json(r)
            return self._result(r, data, _check_json(data))
        if kind == "client_timeout":
            body = self.chat(self.text(self.rng.randint(40, 200)), 8 * mt, ignore_eos=True)
            try:
                r = await c.post(self.url + "/v1/chat/completions", json=body, headers=self.headers,
                                 timeout=self.a.client_timeout)
            except httpx.TimeoutException:
                return "client_hangup", 0, f"client gave up after {self.a.client_timeout:g} s"
            return self._result(r, _json(r), "")
        if kind == "too_big":
            words = self.pool_tokens + max(64, self.pool_tokens // 4)
            body = self.chat(self.text(words), 8)
            r = await c.post(self.url + "/v1/chat/completions", json=body, headers=self.headers)
            res = self._result(r, _json(r), "", expect_4xx=True)
            if res[0] == "ok":  # served a prompt larger than the pool
                return "other_error", 200, f"a {words}-word prompt (pool {self.pool_tokens} tokens) was served"
            return res
        if kind == "over_pool":
            words = max(16, self.pool_tokens // 4)
            body = self.chat(self.text(words), self.pool_tokens, ignore_eos=True, temperature=0.7)
            r = await c.post(self.url + "/v1/chat/completions", json=body, headers=self.headers)
            data = _json(r)
            cls, status, detail = self._result(r, data, "", expect_4xx=True)
            if cls == "ok":
                fin = [ch.get("finish_reason") for ch in data.get("choices", [])]
                usage = data.get("usage") or {}
                detail = f"finish {fin} prompt {usage.get('prompt_tokens')} completion {usage.get('completion_tokens')}"
            return cls, status, detail
        raise ValueError(f"unknown kind {kind}")

    def _result(self, r: httpx.Response, data: Any, problem: str, expect_4xx: bool = False) -> tuple[str, int, str]:
        cls, detail = classify(r.status_code, r.headers, data, expect_4xx, problem if r.status_code == 200 else "")
        return cls, r.status_code, detail

    async def _stream(self, c: httpx.AsyncClient, path: str, body: dict, ttft: list[float], stop_after: int,
                      chat: bool) -> tuple[str, int, str]:
        events, done, usage, err = 0, False, None, None
        async with c.stream("POST", self.url + path, json=body, headers=self.headers) as r:
            if r.status_code != 200:
                await r.aread()
                return self._result(r, _json(r), "")
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    continue
                if not line.startswith("data: {"):
                    continue
                if not ttft:
                    ttft.append(time.monotonic())
                ev = json.loads(line[6:])
                if "error" in ev:
                    err = ev
                    continue
                events += 1
                usage = ev.get("usage") or usage
                if stop_after and events >= stop_after:
                    return "client_hangup", 200, f"closed after {events} events"
            headers = r.headers
        if err is not None:
            cls, detail = classify(200, headers, err)
            return cls, int(error_of(err).get("code") or 200), detail
        problem = "" if done else "no [DONE]"
        if not problem and chat and not (usage and usage.get("completion_tokens")):
            problem = "no usage with completion_tokens"
        cls, detail = classify(200, headers, None, problem=problem)
        return cls, 200, detail

    # drivers --------------------------------------------------------------------------------------------
    async def client_loop(self, kinds: list[str], weights: list[float]) -> None:
        while time.monotonic() < self.end:
            await self.launch(self.rng.choices(kinds, weights)[0])

    async def every(self, period: float, fire) -> None:
        """fire() at half a period, then every period, until the end."""
        if period <= 0:
            return
        k = 0
        while True:
            at = self.t0 + period / 2 + k * period
            if at >= self.end:
                return
            await self.nap(at - time.monotonic())
            if time.monotonic() >= self.end:
                return
            fire()
            k += 1

    def burst(self) -> None:
        n = self.a.burst_factor * self.a.concurrency
        print(f"  [{time.monotonic() - self.t0:7.0f}s] burst of {n}", flush=True)
        for _ in range(n):
            self.launch("burst")

    def latency_table(self) -> dict[str, dict[str, Any]]:
        out = {}
        for kind in sorted({r.kind for r in self.records}):
            rs = [r for r in self.records if r.kind == kind]
            lat = [r.latency_s for r in rs if r.cls != "hung"]
            tt = [r.ttft_s for r in rs if r.ttft_s is not None]
            out[kind] = {"n": len(rs), "by_class": dict(Counter(r.cls for r in rs)),
                         "p50_s": _r(pct(lat, 0.5)), "p99_s": _r(pct(lat, 0.99)), "max_s": _r(max(lat, default=None)),
                         "ttft_p50_s": _r(pct(tt, 0.5)), "ttft_p99_s": _r(pct(tt, 0.99))}
        return out


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _json(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text[:300]


def _check_n(data: Any, n: int) -> str:
    if not isinstance(data, dict):
        return "not JSON"
    choices = data.get("choices") or []
    if len(choices) != n:
        return f"{len(choices)} choices, asked {n}"
    with_lp = [ch for ch in choices if ((ch.get("logprobs") or {}).get("content") or [])]
    if not with_lp:
        return "no choice has logprobs"
    if any(len(t.get("top_logprobs") or []) != 2 for ch in with_lp for t in ch["logprobs"]["content"]):
        return "top_logprobs not 2 per token"
    return ""


def _check_json(data: Any) -> str:
    if not isinstance(data, dict) or not data.get("choices"):
        return "no choices"
    ch = data["choices"][0]
    if ch.get("finish_reason") != "stop":
        return ""  # cut by max_tokens: the JSON may be unfinished
    try:
        obj = json.loads(ch["message"]["content"])
    except (ValueError, KeyError, TypeError):
        return f"invalid JSON: {str(ch.get('message', {}).get('content'))[:80]!r}"
    return "" if isinstance(obj, dict) and {"name", "age"} <= obj.keys() else f"JSON off the schema: {obj!r:.80}"


# ---------------------------------------------------------------------------------------------------------
# sampling

class Sampler:
    def __init__(self, a: argparse.Namespace, url: str, headers: dict[str, str], token: str | None,
                 roots: list[int], names: dict[int, str]) -> None:
        self.a, self.url, self.headers, self.token = a, url, headers, token
        self.roots, self.names = roots, names
        self.samples: list[dict[str, Any]] = []
        self.http = httpx.AsyncClient(timeout=10.0)

    async def workers(self) -> list[dict]:
        try:
            r = await self.http.get(self.url + "/admin/workers", headers=self.headers)
            return r.json().get("workers", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError):
            return []

    async def server(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            out["router"] = router_numbers((await self.http.get(self.url + "/metrics", headers=self.headers)).text)
        except httpx.HTTPError as e:
            out["router"] = {"error": f"{type(e).__name__}: {e}"}
        if self.token is None:
            return out
        for w in await self.workers():
            key = f"{w.get('role')}@{w.get('url')}"
            try:
                r = await self.http.get(w["url"] + "/server_info", headers={TOKEN_HEADER: self.token})
                out[key] = worker_numbers(r.json()) if r.status_code == 200 else {"status": r.status_code}
            except (httpx.HTTPError, ValueError) as e:
                out[key] = {"error": f"{type(e).__name__}: {e}"}
            out[key]["healthy"] = w.get("healthy")
        return out

    async def sample(self, soak: Soak, label: str = "") -> dict[str, Any]:
        t = round(time.monotonic() - soak.t0, 1)
        rss = read_rss(self.roots, self.names) if self.roots else {}
        s = {"t": t, "label": label, "counts": dict(soak.counts), "sent": soak.sent, "in_flight": len(soak.inflight),
             "rss": rss, "client_rss_mb": round(rss_mb(os.getpid()) or 0, 1), "server": await self.server()}
        self.samples.append(s)
        print(progress_line(s), flush=True)
        return s

    async def loop(self, soak: Soak) -> None:
        while True:
            await soak.nap(min(self.a.sample_every, soak.end - time.monotonic()))
            if time.monotonic() >= soak.end:
                return
            await self.sample(soak)


def progress_line(s: dict[str, Any]) -> str:
    c = s["counts"]
    head = (f"[{s['t']:7.0f}s]{s['label']:>6} sent {s['sent']:5d} ok {c.get('ok', 0)} 4xx {c.get('expected_4xx', 0)} "
            f"503 {c.get('overload_503', 0)} err {c.get('other_error', 0)} hung {c.get('hung', 0)} "
            f"hup {c.get('client_hangup', 0)} fly {s['in_flight']}")
    rss = " ".join(f"{n}={v['rss_mb']:.0f}" for n, v in s["rss"].items())
    parts = []
    for key, w in s["server"].items():
        if key == "router" or "kv_used" not in w:
            continue
        ctr = " ".join(f"{k}={v}" for k, v in w.get("counters", {}).items() if v)
        q = " ".join(f"{k}={v}" for k, v in (w.get("queues") or {}).items() if v)
        parts.append(f"{key.split('@')[0]}:{key.rsplit(':', 1)[-1]} kv {w['kv_used']}/{w['kv_total']} "
                     f"fly {w.get('in_flight')}" + (f" q[{q}]" if q else "") + (f" {ctr}" if ctr else ""))
    r = s["server"].get("router", {})
    rr = f"router {r.get('requests_by_status', {})} retries {r.get('retries')} mig {r.get('migrations')}" \
        if "requests_by_status" in r else ""
    return " | ".join(x for x in (head, f"rss MB {rss}" if rss else "", *parts, rr) if x)


def rss_series(samples: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for s in samples:
        for name, v in s["rss"].items():
            out.setdefault(name, []).append({"t": s["t"], "rss_mb": v["rss_mb"], "pid": v["pid"]})
    return out


async def settle(sampler: Sampler, soak: Soak, timeout: float = 60.0) -> dict[str, Any]:
    """Wait (up to `timeout` s) until every worker reports nothing in flight and no active rooms; the
    final sample."""
    deadline = time.monotonic() + timeout
    while True:
        server = await sampler.server()
        busy = [k for k, w in server.items() if k != "router" and (w.get("in_flight") or w.get("active_rooms"))]
        if not busy or time.monotonic() > deadline:
            break
        await asyncio.sleep(2.0)
    return await sampler.sample(soak, "idle")


# ---------------------------------------------------------------------------------------------------------
# main

def parse_mix(spec: str) -> tuple[list[str], list[float]]:
    kinds, weights = [], []
    for item in spec.split(","):
        k, _, w = item.partition("=")
        if k.strip() not in KINDS:
            raise SystemExit(f"--mix: unknown kind {k!r} (kinds: {', '.join(KINDS)})")
        kinds.append(k.strip())
        weights.append(float(w or 1))
    return kinds, weights


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [options] [-- PDSERVE_UP_FLAGS ...]")
    g = p.add_argument_group("the stack")
    g.add_argument("--url", help="soak a running router at this URL instead of starting `pdserve up` "
                   "(words after -- are then ignored)")
    g.add_argument("--pids", default="", help="with --url: comma-separated pids whose process trees' RSS is "
                   "sampled (e.g. the `pdserve up` pid); none: RSS is not read")
    g.add_argument("--internal-token-file", help="with --url: the stack's internal token (pdserve up writes "
                   "LOG_DIR/internal-token), to read each worker's /server_info; none: router numbers only")
    g.add_argument("--api-key", help="client API key, sent as a Bearer token (router --api-key-file)")
    g.add_argument("--log-dir", type=Path, help="where `pdserve up` writes its logs (default: a new temp dir, "
                   "kept after the run)")
    g.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for `pdserve up` to be "
                   "healthy (default 900)")
    g.add_argument("--pool-tokens", type=int, default=0, help="KV pool size the too_big and over_pool requests "
                   "are sized against (default: the smallest decode's kv_total_tokens from /server_info, "
                   "else 16384)")
    w = p.add_argument_group("the workload")
    w.add_argument("--duration", type=float, default=3600, help="seconds of load (default 3600)")
    w.add_argument("--concurrency", type=int, default=6, help="clients, each sending one request after another "
                   "(default 6)")
    w.add_argument("--mix", default=DEFAULT_MIX,
                   help=f"kind=weight,... of the clients' requests (default {DEFAULT_MIX})")
    w.add_argument("--max-tokens", type=int, default=48, help="max_tokens of the usual requests (chat_json twice "
                   "this, hangup_stream 4x, client_timeout 8x with ignore_eos; default 48)")
    w.add_argument("--burst-every", type=float, default=120, help="seconds between bursts (0: none; default 120)")
    w.add_argument("--burst-factor", type=int, default=3, help="a burst is this many x --concurrency streaming "
                   "chats at once (default 3)")
    w.add_argument("--burst-tokens", type=int, default=64, help="tokens of each burst stream, ignore_eos (default 64)")
    w.add_argument("--big-every", type=float, default=90, help="seconds between too_big requests, a prompt larger "
                   "than the KV pool (0: none; default 90)")
    w.add_argument("--over-pool-every", type=float, default=300, help="seconds between over_pool requests, prompt "
                   "+ max_tokens beyond the KV pool (0: none; default 300)")
    w.add_argument("--hangup-after", type=int, default=3, help="events a hangup_stream reads before closing "
                   "(default 3)")
    w.add_argument("--client-timeout", type=float, default=1.5, help="seconds a client_timeout request waits "
                   "(default 1.5)")
    w.add_argument("--hang-limit", type=float, default=600, help="a request without an answer after this many "
                   "seconds counts as hung (default 600: the router's --request-timeout, the longest a client "
                   "behind it waits; a decode's --queue-timeout, 300 s by default, answers a queued request with a "
                   "503 before it)")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload's choices and prompts (default 0)")
    o = p.add_argument_group("sampling and report")
    o.add_argument("--sample-every", type=float, default=60, help="seconds between samples (default 60)")
    o.add_argument("--no-warmup-through-retraction", dest="warmup_through_retraction", action="store_false",
                   help="measure RSS growth from --warmup even when the first retraction comes later (by default "
                   "warm-up lasts until a worker has retracted once: its first retraction writes the host KV pool, "
                   "committed page by page on first touch, a bounded one-time step; the report keeps the growth "
                   "from --warmup alone too, as rss_from_timed_warmup)")
    o.add_argument("--warmup", type=float, help="RSS growth is measured from the first sample at or after this "
                   "many seconds (default min(300, duration / 4))")
    o.add_argument("--flat-mb", type=float, default=20, help="RSS growth after warm-up up to max(this, --flat-pct "
                   "of the first) MB is flat (default 20)")
    o.add_argument("--flat-pct", type=float, default=5, help="see --flat-mb (default 5)")
    o.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "soak.json", help="JSON report "
                   "(default docs/bench/soak.json)")
    return p


async def discover(url: str, headers: dict[str, str], token: str | None, pool_tokens: int) -> tuple[str, int, int]:
    """(model name, KV pool tokens, context length) of the stack."""
    async with httpx.AsyncClient(timeout=10.0) as c:
        card = (await c.get(url + "/v1/models", headers=headers)).json()["data"][0]
        model, ctx = str(card["id"]), int(card.get("max_model_len") or 8192)
        if pool_tokens or token is None:
            return model, pool_tokens or 16384, ctx
        pools = []
        r = await c.get(url + "/admin/workers", headers=headers)
        for w in r.json().get("workers", []) if r.status_code == 200 else []:
            if w.get("role") != "decode":
                continue
            info = (await c.get(w["url"] + "/server_info", headers={TOKEN_HEADER: token})).json()
            total = worker_numbers(info).get("kv_total")
            if total:
                pools.append(int(total))
        return model, min(pools, default=16384), ctx


async def run(a: argparse.Namespace, url: str, token: str | None, roots: list[int], names: dict[int, str]) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model, pool, ctx = await discover(url, headers, token, a.pool_tokens)
    print(f"model {model}, KV pool {pool} tokens (too_big / over_pool sized on it), context {ctx}", flush=True)
    kinds, weights = parse_mix(a.mix)
    soak = Soak(a, url, model, pool, ctx, headers, random.Random(a.seed))
    # no cap on connections: bursts pile up behind a full decode, and a request queued in the client's own
    # pool would read as server latency (or a hang)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    soak.client = httpx.AsyncClient(timeout=httpx.Timeout(a.hang_limit + 30), limits=limits)
    sampler = Sampler(a, url, headers, token, roots, names)
    soak.t0 = time.monotonic()
    soak.end = soak.t0 + a.duration
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, soak.stop_early)
    try:
        await sampler.sample(soak, "start")
        drivers = [asyncio.ensure_future(soak.client_loop(kinds, weights)) for _ in range(a.concurrency)]
        drivers += [asyncio.ensure_future(soak.every(a.burst_every, soak.burst)),
                    asyncio.ensure_future(soak.every(a.big_every, lambda: soak.launch("too_big"))),
                    asyncio.ensure_future(soak.every(a.over_pool_every, lambda: soak.launch("over_pool"))),
                    asyncio.ensure_future(sampler.loop(soak))]
        await asyncio.gather(*drivers)
        if soak.inflight:
            print(f"  load ended; waiting for {len(soak.inflight)} requests in flight", flush=True)
            await asyncio.gather(*list(soak.inflight))
        final = await settle(sampler, soak)
    finally:
        await soak.client.aclose()
        await sampler.http.aclose()
    duration = soak.end - soak.t0  # shorter when stopped early
    timed = a.warmup if a.warmup is not None else min(300.0, duration / 4)
    first_retraction = first_counter_t(sampler.samples, "retractions")
    warmup = timed if a.warmup_through_retraction is False or first_retraction is None else max(timed, first_retraction)
    series = rss_series(sampler.samples)
    run_end = sampler.samples[-1]["t"]
    rss = {n: growth(s, warmup, run_end, a.flat_mb, a.flat_pct) for n, s in series.items()}
    rss_timed = {n: growth(s, timed, run_end, a.flat_mb, a.flat_pct) for n, s in series.items()}
    errors = [vars(r) for r in soak.records if r.cls in ("other_error", "hung")][:50]
    return {"duration_s": round(duration, 1), "stopped_early": soak.stopped.is_set(), "model": model,
            "pool_tokens": pool, "context_length": ctx, "warmup_s": warmup,
            "timed_warmup_s": timed, "first_retraction_s": first_retraction, "rss_from_timed_warmup": rss_timed,
            "flat_rule": f"growth <= max({a.flat_mb:g} MB, {a.flat_pct:g}% of the first sample after warm-up)",
            "counts": {k: soak.counts.get(k, 0) for k in CLASSES}, "sent": soak.sent,
            "by_kind": soak.latency_table(), "rss": rss, "rss_series": series,
            "verdict": {**verdict(soak.counts, soak.sent, rss), "drained_after": drained(final)},
            "errors_sample": errors,
            "details_sample": _details(soak.records), "final": final, "samples": sampler.samples}


def first_counter_t(samples: list[dict[str, Any]], counter: str) -> float | None:
    """t of the first sample in which some worker's `counter` (under its /server_info "counters") is above 0
    (None: never)."""
    for s in samples:
        for k, w in s.get("server", {}).items():
            if k != "router" and isinstance(w, dict) and ((w.get("counters") or {}).get(counter) or 0) > 0:
                return s["t"]
    return None


def drained(sample: dict[str, Any]) -> bool | None:
    """Every worker idle in `sample` (nothing in flight, no active rooms, no KV in use); None: not read."""
    ws = [w for k, w in sample["server"].items() if k != "router"]
    if not ws:
        return None
    return all(not w.get("in_flight") and not w.get("active_rooms") and w.get("kv_used") == 0 for w in ws)


def _details(records: list[Record]) -> dict[str, list[str]]:
    """A few distinct details per kind/class (what the 4xx, 503 and over_pool answers said)."""
    out: dict[str, list[str]] = {}
    for r in records:
        if r.detail and r.cls not in ("client_hangup",):
            lst = out.setdefault(f"{r.kind}/{r.cls}", [])
            d = re.sub(r"\d+", "N", r.detail) if r.kind != "over_pool" else r.detail
            if d not in lst and len(lst) < 5:
                lst.append(d)
    return out


def print_report(res: dict[str, Any]) -> None:
    print("\nRSS per process (MB): first after warm-up / last / max, growth")
    print(f"{'process':<34}{'first':>9}{'last':>9}{'max':>9}{'growth':>9}{'%':>7}{'MB/h':>8}  call")
    for name, g in res["rss"].items():
        if "first_mb" in g:
            print(f"{name:<34}{g['first_mb']:9.1f}{g['last_mb']:9.1f}{g['max_mb']:9.1f}{g['growth_mb']:9.1f}"
                  f"{g['growth_pct'] or 0:7.1f}{g['slope_mb_per_h']:8.1f}  {g['call']}")
        else:
            print(f"{name:<34}{'':>9}{'':>9}{g.get('max_mb', 0):9.1f}{'':>9}{'':>7}{'':>8}  {g['call']}")
    print(f"warm-up {res['warmup_s']:g} s (timed {res['timed_warmup_s']:g} s, first retraction at "
          f"{res['first_retraction_s']} s); flat: {res['flat_rule']}")
    print("\nrequests by class: " + ", ".join(f"{k} {v}" for k, v in res["counts"].items()) + f" (sent {res['sent']})")
    print(f"\n{'kind':<16}{'n':>6}{'p50 s':>9}{'p99 s':>9}{'max s':>9}{'ttft p50':>10}{'ttft p99':>10}  classes")
    for kind, k in res["by_kind"].items():
        def f(x):
            return f"{x:.2f}" if x is not None else "-"
        print(f"{kind:<16}{k['n']:>6}{f(k['p50_s']):>9}{f(k['p99_s']):>9}{f(k['max_s']):>9}"
              f"{f(k['ttft_p50_s']):>10}{f(k['ttft_p99_s']):>10}  {k['by_class']}")
    v = res["verdict"]
    print(f"\nverdict: hung {v['hung']}, answered {v['answered']}/{v['sent']}, other_error {v['other_error']}, "
          f"RSS flat {v['rss_flat']}" + (f" (not flat: {', '.join(v['rss_not_flat'])})" if v["rss_not_flat"] else "")
          + f" -> {'PASS' if v['pass'] else 'FAIL'}; workers drained after the run: {v['drained_after']}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    up_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, up_args = argv[:i], argv[i + 1:]
    a = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # while starting: stop the stack as Ctrl-C does
    stack: UpStack | None = None
    started = time.time()
    try:
        if a.url:
            url = a.url.rstrip("/")
            token = Path(a.internal_token_file).read_text().strip() if a.internal_token_file else None
            roots = [int(p) for p in a.pids.split(",") if p.strip()]
            names: dict[int, str] = {}
            log_dir = None
        else:
            log_dir = a.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
            log_dir.mkdir(parents=True, exist_ok=True)
            print(f"starting pdserve up {' '.join(up_args)} (logs in {log_dir})", flush=True)
            stack = UpStack(up_args, log_dir, a.startup_timeout)
            url, token, roots, names = stack.url, stack.token, [stack.proc.pid], stack.names
            print(f"pdserve up ready at {url} after {time.time() - started:.0f} s", flush=True)
        res = asyncio.run(run(a, url, token, roots, names))
    finally:
        rc = stack.stop() if stack is not None else None
    res.update(args={k: str(v) for k, v in vars(a).items()}, up_args=up_args, url=url,
               started=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)), wall_s=round(time.time() - started),
               cpus=os.cpu_count(), loadavg_end=os.getloadavg(), log_dir=str(log_dir) if log_dir else None,
               up_exit_code=rc, up_events=stack.events if stack else [], log_problems=log_problems(log_dir))
    print_report(res)
    if stack is not None:
        print(f"pdserve up exited with {rc}; logs in {log_dir}; problems per log: {res['log_problems']}")
        if stack.events:
            print("pdserve up events:\n  " + "\n  ".join(stack.events))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if res["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
