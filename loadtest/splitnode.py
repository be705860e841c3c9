"""Split-node load test: router, prefill and decode each in its own network namespace.

    python -m loadtest.splitnode --duration 60 --out out/splitnode [--delay-ms 1 --rate 1gbit]

1. Namespaces {prefix}-rtr/-pre/-dec on a bridge (loadtest/netns.py), 192.0.2.1/.2/.3.
2. Prefill and decode start inside theirs (UCX forced onto TCP over eth0, so KV crosses the veth
   links), then the router, pointed at both; all polled for /health from the router namespace.
3. Worker /metrics and /server_info are read, `pdserve bench` runs inside the router namespace for
   the duration, the pools are polled until kv_used_tokens is 0, and the metrics are read again.
4. Checks: zero failed requests; both pools fully free; transfer bytes counted by prefill and decode,
   plus the bytes the decode's prefix cache held already (`transfer_bytes_reused_total`),
   == sum over requests of ceil(prompt_tokens / page_size) * page_size * kv_bytes_per_token.
5. Everything is killed and the namespaces deleted (also on SIGINT / SIGTERM / failure).
Report: OUT/splitnode.json (+ the bench's JSON and PNGs under OUT/bench, service logs in OUT/logs).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.cpus import threads_per_worker
from engine.models.embedded import resolve_model_path
from loadtest import promtext
from loadtest.netns import Netns, NetnsConfig, Shaping
from loadtest.services import ALWAYS_PD

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
# Counter of KV bytes moved by a worker's transfer engine (summed over its labels). Adjust here if the
# services name it differently; the report lists every pdserve_* metric containing "bytes".
TRANSFER_BYTES_METRIC = "pdserve_worker_transfer_bytes_total"
TRANSFER_BYTES_LABELS: dict[str, str] = {}  # e.g. {"name": "transfer_bytes"} for a labelled counter
REUSED_BYTES_METRIC = "pdserve_worker_transfer_bytes_reused_total"  # decode: prompt pages it held already
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ROUTER_PORT = 8000
WORKER_PORT = 30000  # every worker has its own node (address)
BOOTSTRAP_PORT = 8998


@dataclass(frozen=True)
class SplitNodeConfig:
    out_dir: str
    model: str = ""  # "" = the embedded model
    duration_s: float = 60.0
    request_rate: float = 1.0
    concurrency: int = 6
    num_prompts: int = 64
    input_len: int = 192
    input_len_std: float = 64.0
    output_len: int = 24
    page_size: int = 16
    dtype: str = "float32"
    shaping: Shaping = field(default_factory=Shaping)
    prefix: str = "pdl"
    ready_timeout_s: float = 300.0
    drain_timeout_s: float = 60.0
    # the prefill and decode share this machine's CPUs: half each (engine.cpus), never all of them each
    service_args: tuple[str, ...] = field(default_factory=lambda: ("--threads", str(threads_per_worker(2))))
    # flags for the decodes only; by default every prompt crosses the nodes (the transfer is what this checks)
    decode_args: tuple[str, ...] = ALWAYS_PD
    router_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.duration_s <= 3600:
            raise ValueError("--duration must be in (0, 3600] seconds")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPE_BYTES)}")
        if self.page_size < 1 or self.num_prompts < 1 or self.concurrency < 1:
            raise ValueError("--page-size, --num-prompts and --concurrency must be >= 1")


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """num_layers * 2 (K and V) * num_kv_heads * head_dim * dtype bytes, from config.json."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * DTYPE_BYTES[dtype]


def info_value(info: dict, key: str):  # noqa: ANN201
    """A /server_info field: top level, else summed (numbers) or first (other) over internal_states."""
    if key in info:
        return info[key]
    vals = [st[key] for st in info.get("internal_states") or [] if isinstance(st, dict) and key in st]
    if not vals:
        return None
    return sum(vals) if all(isinstance(v, (int, float)) for v in vals) else vals[0]


def expected_kv_bytes(prompt_tokens: list[int], page_size: int, bytes_per_token: int) -> int:
    """KV moves in whole pages: each prompt of n tokens implies ceil(n / page_size) pages."""
    return sum(math.ceil(n / page_size) * page_size * bytes_per_token for n in prompt_tokens)


class Cluster:
    """A router and its workers inside a Netns, one worker per node (`roles`: node -> prefill|decode);
    URLs as seen from inside the namespaces. `spawn_worker` (re)starts one worker in its node."""

    def __init__(self, net: Netns, cfg: SplitNodeConfig, model_dir: Path, roles: dict[str, str] | None = None) -> None:
        self.net, self.cfg, self.model_dir = net, cfg, model_dir
        self.roles = roles or {"pre": "prefill", "dec": "decode"}
        nc = net.cfg
        self.url = {"rtr": f"http://{nc.ip('rtr')}:{ROUTER_PORT}"}
        self.url |= {n: f"http://{nc.ip(n)}:{WORKER_PORT}" for n in self.roles}
        self.procs: dict[str, subprocess.Popen] = {}  # node -> its current process
        self.logs = Path(cfg.out_dir) / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {"PYTHONPATH": str(REPO), "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0",
                    "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONUNBUFFERED": "1"}

    def nodes(self, role: str) -> list[str]:
        return [n for n, r in self.roles.items() if r == role]

    def _worker_argv(self, node: str, role: str) -> list[str]:
        ip = self.net.cfg.ip(node)
        argv = [sys.executable, "-m", "pdserve", role, "--model", str(self.model_dir), "--host", ip,
                "--port", str(WORKER_PORT), "--advertise-host", ip, "--device", "cpu",
                "--dtype", self.cfg.dtype, "--page-size", str(self.cfg.page_size), *self.cfg.service_args]
        if role == "prefill":
            argv += ["--bootstrap-port", str(BOOTSTRAP_PORT)]
        return argv + list(self.cfg.decode_args if role == "decode" else ())

    def spawn_worker(self, node: str, extra: tuple[str, ...] = ()) -> subprocess.Popen:
        """Start node's worker (again: its log is appended to), with `extra` flags last."""
        role = self.roles[node]
        argv = self._worker_argv(node, role) + list(extra)
        self.procs[node] = self.net.spawn(node, argv, self.logs / f"{role}-{node}.log", self.env)
        return self.procs[node]

    def worker_arg(self, node: str) -> str:
        """How the router names this worker on its command line."""
        url = self.url[node]
        return f"{url},bootstrap_port={BOOTSTRAP_PORT}" if self.roles[node] == "prefill" else url

    def start(self) -> None:
        for node in self.roles:
            self.spawn_worker(node)
        self.wait_ok([self.url[n] + "/health" for n in self.roles])
        router = [sys.executable, "-m", "pdserve", "router", "--host", self.net.cfg.ip("rtr"),
                  "--port", str(ROUTER_PORT), *self.cfg.router_args]
        for node, role in self.roles.items():
            router += [f"--{role}", self.worker_arg(node)]
        self.procs["rtr"] = self.net.spawn("rtr", router, self.logs / "router.log", self.env)
        self.wait_ok([self.url["rtr"] + "/health"])

    def probe(self, urls: list[str], wait_s: float = 0.0) -> list[dict]:
        res = self.net.run("rtr", [sys.executable, "-m", "loadtest.probe", *urls, "--wait", str(wait_s)],
                           timeout=wait_s + 30, env={"PYTHONPATH": str(REPO)})
        return json.loads(res.stdout)

    def wait_ok(self, urls: list[str]) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        while time.monotonic() < deadline:
            self._check_alive()
            if all(r["status"] == 200 for r in self.probe(urls, wait_s=5.0)):
                return
        raise RuntimeError(f"not healthy after {self.cfg.ready_timeout_s} s: {urls} (logs: {self.logs})")

    def _check_alive(self) -> None:
        for p in self.procs.values():
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(p.args[6:8])} exited with {p.returncode}; logs in {self.logs}")

    def worker_state(self) -> dict:
        """/metrics samples and /server_info of prefill and decode."""
        urls = [self.url[n] + path for n in self.roles for path in ("/metrics", "/server_info")]
        got = {r["url"]: r for r in self.probe(urls)}
        out = {}
        for n in self.roles:
            m, s = got[self.url[n] + "/metrics"], got[self.url[n] + "/server_info"]
            if m["status"] != 200 or s["status"] != 200:
                raise RuntimeError(f"{n}: /metrics {m['status']}, /server_info {s['status']}: "
                                   f"{s['text'][:200]}")
            out[n] = {"metrics": promtext.parse(m["text"]), "info": json.loads(s["text"])}
        return out

    def wait_pools_free(self) -> dict:
        deadline = time.monotonic() + self.cfg.drain_timeout_s
        while True:
            state = self.worker_state()
            used = {n: info_value(state[n]["info"], "kv_used_tokens") for n in state}
            if all(u == 0 for u in used.values()) or time.monotonic() >= deadline:
                return state
            time.sleep(0.5)  # polling interval: pages are freed asynchronously after the last stream

    def bench(self) -> dict:
        c = self.cfg
        out = Path(c.out_dir) / "bench"
        argv = [sys.executable, "-m", "loadtest.cli", "--url", self.url["rtr"], "--tokenizer",
                str(self.model_dir), "--num-requests", str(c.num_prompts), "--duration", str(c.duration_s),
                "--request-rate", str(c.request_rate), "--concurrency", str(c.concurrency),
                "--input-len", str(c.input_len), "--input-len-std", str(c.input_len_std),
                "--output-len", str(c.output_len), "--out", str(out), "--no-progress", "--timeout", "120"]
        res = self.net.run("rtr", argv, timeout=c.duration_s + 300, env={"PYTHONPATH": str(REPO)})
        (self.logs / "bench.log").write_text(res.stdout + res.stderr)
        if not (out / "bench.json").exists():
            raise RuntimeError(f"bench wrote no JSON (rc {res.returncode}): {res.stderr[-1500:]}")
        return json.loads((out / "bench.json").read_text())


def _bytes_delta(before: dict, after: dict, node: str, metric: str = TRANSFER_BYTES_METRIC) -> float:
    a = promtext.total(after[node]["metrics"], metric, **TRANSFER_BYTES_LABELS)
    b = promtext.total(before[node]["metrics"], metric, **TRANSFER_BYTES_LABELS)
    return (0.0 if math.isnan(a) and metric != TRANSFER_BYTES_METRIC else a) - (0.0 if math.isnan(b) else b)


def check(cfg: SplitNodeConfig, bench: dict, before: dict, after: dict, bytes_per_token: int) -> dict:
    """The acceptance checks; `problems` is empty when all hold. KV bytes per token and page size
    come from the prefill's /server_info when it reports them, else from config.json and the flags."""
    reqs = bench["requests"]
    info = after["pre"]["info"]
    bytes_per_token = info_value(info, "kv_bytes_per_token") or bytes_per_token
    page_size = info_value(info, "page_size") or cfg.page_size
    ok = [r for r in reqs if r["error"] is None]
    prompt_tokens = [r["server_prompt_tokens"] or r["prompt_len"] for r in ok]
    expected = expected_kv_bytes(prompt_tokens, page_size, bytes_per_token)
    moved = {n: _bytes_delta(before, after, n) for n in ("pre", "dec")}
    reused = _bytes_delta(before, after, "dec", REUSED_BYTES_METRIC)  # decode-side prefix reuse: not moved
    pools = {n: {k: info_value(after[n]["info"], k) for k in ("kv_used_tokens", "kv_total_tokens")}
             for n in after}
    problems = []
    s = bench["summary"]
    if s["failed"] or not s["completed"]:
        problems.append(f"{s['failed']} failed of {s['num_requests']} requests: {s['errors'][:3]}")
    for n, p in pools.items():
        if p["kv_used_tokens"] != 0:
            problems.append(f"{n} pool not free after load: {p}")
    for n, v in moved.items():
        if v + reused != expected:
            problems.append(f"{n}: {TRANSFER_BYTES_METRIC} moved {v:.0f} bytes (+ {reused:.0f} reused on the "
                            f"decode), prompts imply {expected}")
    names = {n: promtext.matching(after[n]["metrics"], "pdserve_", "bytes") for n in after}
    return {"problems": problems, "expected_kv_bytes": expected, "transfer_bytes": moved,
            "reused_kv_bytes": reused, "pools": pools,
            "kv_bytes_per_token": bytes_per_token, "page_size": page_size, "requests": len(reqs),
            "byte_metrics_seen": names}


def run(cfg: SplitNodeConfig) -> dict:
    model_dir = resolve_model_path(cfg.model)
    bpt = kv_bytes_per_token(model_dir, cfg.dtype)
    with Netns(NetnsConfig(prefix=cfg.prefix, nodes=("rtr", "pre", "dec"), shaping=cfg.shaping)) as net:
        cluster = Cluster(net, cfg, model_dir)
        cluster.start()
        before = cluster.worker_state()
        bench = cluster.bench()
        after = cluster.wait_pools_free()
        report = check(cfg, bench, before, after, bpt)
    report |= {"config": asdict(cfg), "summary": bench["summary"]}
    Path(cfg.out_dir, "splitnode.json").write_text(json.dumps(report, indent=1, default=str))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.splitnode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SplitNodeConfig(out_dir="")
    p.add_argument("--out", required=True, help="output directory (report, bench JSON/PNGs, logs)")
    p.add_argument("--model", default="", help="HF model directory (default: the embedded model)")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    p.add_argument("--request-rate", type=float, default=d.request_rate, help="Poisson arrivals per second")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="max requests in flight")
    p.add_argument("--input-len", type=int, default=d.input_len, help="mean prompt tokens")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument("--delay-ms", type=float, default=0.0, help="netem one-way delay per node link (ms)")
    p.add_argument("--rate", default="", help="link rate limit, tc syntax (e.g. 1gbit)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = SplitNodeConfig(out_dir=args.out, model=args.model, duration_s=args.duration,
                              request_rate=args.request_rate, concurrency=args.concurrency,
                              input_len=args.input_len, output_len=args.output_len,
                              shaping=Shaping(args.delay_ms, args.rate))
    except ValueError as e:
        print(f"splitnode: {e}", file=sys.stderr)
        return 2
    report = run(cfg)
    print(json.dumps({k: report[k] for k in ("problems", "expected_kv_bytes", "transfer_bytes", "pools")},
                     indent=1))
    return 0 if not report["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
