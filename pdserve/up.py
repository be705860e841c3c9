"""`pdserve up`: router + prefill + decode services on this machine, the local quick start.

1. Pick free ports, write a random internal token (workers only accept requests that carry it).
2. Start N prefill and M decode services (`python -m pdserve prefill|decode ...`) and the router, each
   in its own session, logs in --log-dir. On CPU each worker gets `--threads` = max(1, CPUs // workers)
   (CPUs: this process's affinity, capped by its cgroup quota), so N+M workers never run more compute
   threads than the machine has cores; `--threads`, or `--threads` inside --worker-args, overrides it.
   With --prefill-tp/--decode-tp a worker runs that many rank processes (`--tp`): the CPUs are divided
   by ranks, not workers, and on cuda each rank gets its own GPU (consecutive GPUs per worker).
3. Wait until every worker's and the router's /health answers 200, printing progress; if a child
   exits first, print its log tail, stop the rest, exit 1.
4. Print the URL and a curl example, then supervise the children until Ctrl-C / SIGTERM
   (pdserve/supervise.py): with --restart on-failure (default) a child that exits non-zero is started
   again with the same flags and ports after a backoff (1, 2, 4 ... 30 s), logged here; the router
   ejects a dead worker after failed health probes and re-admits it once healthy, the others keep
   serving. With --restart never the first exit stops everything and exits 1.
5. On Ctrl-C / SIGTERM: stop the router, then the workers (SIGTERM, SIGKILL after --grace seconds),
   exit 0.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.configs import build
from common.http import TOKEN_HEADER
from common.logs import add_observability_args
from common.procs import Child, free_port, http_ok, stop_all
from engine.config import EMBEDDED_MODEL
from engine.cpus import cpu_budget, threads_per_worker
from pdserve.supervise import POLICIES, Supervisor
from service.lora_args import add_lora_args, lora_flags


@dataclass(frozen=True)
class UpConfig:
    """`pdserve up`'s flags, built from the parsed flags by name (each field is a flag's dest; the
    parser's defaults are these). Validation raises ValueError naming the flag."""

    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    model: str = EMBEDDED_MODEL
    device: str = "auto"
    max_total_tokens: int | None = None
    transfer_backend: str = "ucx"
    prefill_policy: str = "least_load"
    decode_policy: str = "least_load"
    api_key_file: str | None = None
    threads: int = 0
    worker_args: str = ""
    prefill_args: str = ""
    decode_args: str = ""
    enable_priority_scheduling: bool = False  # passed to every worker (engine.scheduling.priority)
    schedule_low_priority_values_first: bool = False
    hicache_host_tokens: int = 0  # passed to every worker (engine/kvcache/hicache); 0: off
    hicache_write_policy: str = "write_back"
    hicache_dir: str = ""
    hicache_disk_bytes: int = 1 << 30
    speculative: str = ""  # passed to every worker (engine/extras/speculative); "": off
    num_speculative_tokens: int = 4
    draft_model: str = ""
    lora_paths: tuple[str, ...] = ()  # passed to every worker (engine/extras/lora, service/lora_args.py)
    max_loaded_loras: int = 0
    max_lora_rank: int = 64
    max_loras_per_batch: int = 8
    otlp_endpoint: str = ""
    log_format: str = "text"
    startup_timeout: float = 900.0
    grace: float = 10.0
    restart: str = "on-failure"
    log_dir: str | None = None
    worker_cmd: str = f"{shlex.quote(sys.executable)} -m pdserve"

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode must be >= 1")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("--prefill-tp and --decode-tp must be >= 1")
        if self.threads < 0:
            raise ValueError("--threads must be >= 0 (0: divide the CPUs among the workers)")


def build_parser() -> argparse.ArgumentParser:
    d = UpConfig()
    p = argparse.ArgumentParser(
        prog="pdserve up", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prefill", type=int, default=d.prefill, help="number of prefill services")
    p.add_argument("--decode", type=int, default=d.decode, help="number of decode services")
    p.add_argument("--prefill-tp", type=int, default=d.prefill_tp,
                   help="tensor-parallel ranks of each prefill service (its --tp: one process per rank; on cuda "
                        "each rank takes its own GPU)")
    p.add_argument("--decode-tp", type=int, default=d.decode_tp,
                   help="tensor-parallel ranks of each decode service (its --tp); may differ from --prefill-tp")
    p.add_argument("--host", default=d.host, help="router bind address (workers bind 127.0.0.1)")
    p.add_argument("--port", type=int, default=d.port, help="router port")
    p.add_argument("--model", default=d.model, help="model for every worker (see pdserve prefill --help)")
    p.add_argument(
        "--device", default=d.device, help="cpu, cuda or cuda:N; with cuda and several GPUs, one GPU per worker"
    )
    p.add_argument("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool size in tokens per worker")
    p.add_argument("--transfer-backend", default=d.transfer_backend, choices=("ucx", "fake"),
                   help="KV transfer backend")
    p.add_argument("--prefill-policy", default=d.prefill_policy, help="router policy for prefill workers")
    p.add_argument("--decode-policy", default=d.decode_policy, help="router policy for decode workers")
    p.add_argument("--api-key-file", default=d.api_key_file, help="client API keys for the router (one per line)")
    p.add_argument(
        "--threads",
        type=int,
        default=d.threads,
        help="torch CPU threads per worker rank (0: divide this machine's CPUs among the ranks, "
        "max(1, CPUs // (prefill * prefill_tp + decode * decode_tp)), CPUs from the affinity mask capped by "
        "the cgroup quota; not passed when the workers compute on a GPU)",
    )
    p.add_argument("--worker-args", default=d.worker_args, help="extra flags for every worker, one shell-quoted string")
    p.add_argument("--prefill-args", default=d.prefill_args,
                   help="extra flags for the prefill workers only, one shell-quoted string")
    p.add_argument(
        "--decode-args",
        default=d.decode_args,
        help="extra flags for the decode workers only, one shell-quoted string "
        "(e.g. '--local-prefill-threshold 0' to disaggregate every prompt)",
    )
    p.add_argument("--enable-priority-scheduling", action="store_true",
                   help="every worker orders waiting requests by their 'priority' and lets urgent ones preempt "
                        "less urgent running ones (see pdserve colocated --help); the router forwards 'priority'")
    p.add_argument("--schedule-low-priority-values-first", action="store_true",
                   help="with --enable-priority-scheduling: a lower 'priority' value is more urgent")
    p.add_argument("--hicache-host-tokens", type=int, default=d.hicache_host_tokens,
                   help="every worker keeps evicted prefix-cache pages in a host tier of this many tokens "
                        "(0: off; see pdserve colocated --help)")
    p.add_argument("--hicache-write-policy", default=d.hicache_write_policy, choices=("write_back", "write_through"),
                   help="with --hicache-host-tokens: when pages are copied to the host (see pdserve colocated --help)")
    p.add_argument("--hicache-dir", default=d.hicache_dir,
                   help="with --hicache-host-tokens: disk tier directory (each worker keeps its own subdirectory)")
    p.add_argument("--hicache-disk-bytes", type=int, default=d.hicache_disk_bytes,
                   help="with --hicache-dir: each worker's disk tier bound in bytes")
    p.add_argument("--speculative", default=d.speculative, choices=("ngram", "draft"),
                   help="speculative decoding on every decode (prefills get it too: the pair must agree); "
                        "ngram or draft (see pdserve decode --help; --ngram-min/--ngram-max and the switch-off "
                        "flags go in --worker-args)")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="with --speculative: tokens proposed per step")
    p.add_argument("--draft-model", default=d.draft_model, help="with --speculative draft: the draft model directory")
    add_lora_args(p)  # passed to every worker
    add_observability_args(p)  # --otlp-endpoint, --log-format: passed to the router and every worker
    p.add_argument(
        "--startup-timeout", type=float, default=d.startup_timeout, help="seconds to wait for everything to be healthy"
    )
    p.add_argument(
        "--grace", type=float, default=d.grace, help="seconds between SIGTERM and SIGKILL when stopping"
    )
    p.add_argument(
        "--restart",
        default=d.restart,
        choices=POLICIES,
        help="on-failure: restart a child (worker or router) that exits non-zero, with backoff 1, 2, 4 ... 30 s "
        "(reset after 60 s up), same flags and ports; never: the first exit stops everything (exit 1)",
    )
    p.add_argument("--log-dir", default=d.log_dir, help="where the children's logs go (default: a new temp dir)")
    p.add_argument(
        "--worker-cmd",
        default=d.worker_cmd,
        help="command that runs a worker, followed by its role and flags (default: this python -m pdserve)",
    )
    return p


def _devices(device: str, n: int) -> list[str]:
    if device != "cuda":
        return [device] * n
    import torch

    count = torch.cuda.device_count()
    return [f"cuda:{i % count}" if count > 1 else "cuda" for i in range(n)]


def _tp_flags(device: str, tps: list[int]) -> list[list[str]]:
    """Each worker's --device (and --tp, --tp-devices when its TP > 1): one device per worker as
    `_devices` gives, or on cuda a run of consecutive GPUs per TP group (wrapping around)."""
    if device == "auto" and any(t > 1 for t in tps) and _uses_gpu(device):
        device = "cuda"
    if device != "cuda" or all(t == 1 for t in tps):
        return [["--device", d] + (["--tp", str(t)] if t > 1 else []) for d, t in zip(_devices(device, len(tps)), tps)]
    gpus, out = _devices(device, sum(tps)), []
    for t in tps:
        mine, gpus = gpus[:t], gpus[t:]
        out.append(["--device", mine[0]] if t == 1 else
                   ["--device", "cuda", "--tp", str(t), "--tp-devices", ",".join(mine)])
    return out


def _uses_gpu(device: str) -> bool:
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def worker_threads(a: UpConfig, extra: list[str]) -> int | None:
    """`--threads` for each worker: None when the user set it in --worker-args or the workers use a GPU."""
    if any(x == "--threads" or x.startswith("--threads=") for x in extra):
        return None
    if a.threads:
        return a.threads
    if _uses_gpu(a.device):
        return None
    return threads_per_worker(a.prefill * a.prefill_tp + a.decode * a.decode_tp)


def _observability_flags(a: UpConfig) -> list[str]:
    flags = ["--log-format", a.log_format]
    return flags + ["--otlp-endpoint", a.otlp_endpoint] if a.otlp_endpoint else flags


def _hicache_flags(a: UpConfig) -> list[str]:
    """The --hicache-* flags every worker gets (none while the host tier is off)."""
    if not a.hicache_host_tokens:
        return ["--hicache-dir", a.hicache_dir] if a.hicache_dir else []  # the worker refuses it, naming the flag
    out = ["--hicache-host-tokens", str(a.hicache_host_tokens), "--hicache-write-policy", a.hicache_write_policy,
           "--hicache-disk-bytes", str(a.hicache_disk_bytes)]
    return out + (["--hicache-dir", a.hicache_dir] if a.hicache_dir else [])


def _spec_flags(a: UpConfig) -> list[str]:
    """The speculative-decoding flags every worker gets (none while off; a stray --draft-model is passed so
    the worker refuses it, naming the flag)."""
    out = ["--draft-model", a.draft_model] if a.draft_model else []
    if not a.speculative:
        return out
    return out + ["--speculative", a.speculative, "--num-speculative-tokens", str(a.num_speculative_tokens)]


def _spawn(name: str, argv: list[str], url: str, log_dir: Path) -> Child:
    child = Child(name, argv, log_dir / f"{name}.log", url=url)
    print(f"started {name} pid {child.pid}: {url} (log {child.log_path})", flush=True)
    return child


def start_all(a: UpConfig, log_dir: Path, token_file: Path, children: list[Child]) -> None:
    """Spawn the workers, then the router, into `children` (kept in stop order: router first), so a
    signal in the middle still leaves every started child in the list."""
    base = shlex.split(a.worker_cmd)
    extra = shlex.split(a.worker_args) + _observability_flags(a)
    if a.max_total_tokens:
        extra += ["--max-total-tokens", str(a.max_total_tokens)]
    extra += [f for f, on in (("--enable-priority-scheduling", a.enable_priority_scheduling),
                              ("--schedule-low-priority-values-first", a.schedule_low_priority_values_first)) if on]
    extra += _hicache_flags(a)
    extra += _spec_flags(a)
    extra += lora_flags(a)
    threads = worker_threads(a, extra)
    if threads is not None:
        extra += ["--threads", str(threads)]
        print(f"each worker rank computes with --threads {threads} ({cpu_budget()} CPUs, "
              f"{a.prefill * a.prefill_tp + a.decode * a.decode_tp} ranks)", flush=True)
    roles = ["prefill"] * a.prefill + ["decode"] * a.decode
    tps = [a.prefill_tp if role == "prefill" else a.decode_tp for role in roles]
    workers: list[Child] = []
    router_workers: list[str] = []
    for i, (role, placement) in enumerate(zip(roles, _tp_flags(a.device, tps))):
        port = free_port()
        argv = [
            *base,
            role,
            "--port",
            str(port),
            "--model",
            a.model,
            *placement,
            "--internal-token-file",
            str(token_file),
            *extra,
        ]
        argv += shlex.split(a.prefill_args if role == "prefill" else a.decode_args)
        if role == "prefill":
            bootstrap_port = free_port()
            argv += ["--bootstrap-port", str(bootstrap_port), "--transfer-backend", a.transfer_backend]
            router_workers += ["--prefill", f"http://127.0.0.1:{port},bootstrap_port={bootstrap_port}"]
        else:
            argv += ["--transfer-backend", a.transfer_backend]
            router_workers += ["--decode", f"http://127.0.0.1:{port}"]
        index = i if role == "prefill" else i - a.prefill
        workers.append(_spawn(f"{role}-{index}", argv, f"http://127.0.0.1:{port}", log_dir))
        children.append(workers[-1])
    router_argv = [
        sys.executable,
        "-m",
        "pdserve",
        "router",
        "--host",
        a.host,
        "--port",
        str(a.port),
        "--internal-token-file",
        str(token_file),
        "--prefill-policy",
        a.prefill_policy,
        "--decode-policy",
        a.decode_policy,
    ]
    router_argv += router_workers + _observability_flags(a)
    if a.api_key_file:
        router_argv += ["--api-key-file", a.api_key_file]
    host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    children.insert(0, _spawn("router", router_argv, f"http://{host}:{a.port}", log_dir))


def _healthy(c: Child, token: str) -> bool:
    return http_ok(c.url + "/health", {TOKEN_HEADER: token})


def wait_healthy(children: list[Child], token: str, timeout: float) -> Child | None:
    """None once all are healthy; the child that died (or still waits at the timeout) otherwise."""
    t0, last_print = time.monotonic(), 0.0
    pending = list(reversed(children))  # workers first, router last
    while pending:
        for c in list(pending):
            if c.popen.poll() is not None:
                return c
            if _healthy(c, token):
                pending.remove(c)
                print(f"  {c.name} healthy after {time.monotonic() - t0:.0f}s", flush=True)
        elapsed = time.monotonic() - t0
        if pending and elapsed > timeout:
            return pending[0]
        if pending and elapsed - last_print >= 10:
            last_print = elapsed
            print(f"  waiting for {', '.join(c.name for c in pending)} ({elapsed:.0f}s)", flush=True)
        time.sleep(0.25)
    return None


def _model_name(router: Child, api_key_file: str | None) -> str:
    headers = {}
    if api_key_file:
        key = next(s.strip() for s in Path(api_key_file).read_text().splitlines() if s.strip())
        headers["Authorization"] = f"Bearer {key}"
    try:
        data = httpx.get(router.url + "/v1/models", headers=headers, timeout=5.0).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return "default"


def _print_ready(router: Child, model: str, with_key: bool) -> None:
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}], "max_tokens": 32}}'
    auth = " -H 'Authorization: Bearer <key>'" if with_key else ""
    print(
        f"\npdserve is up: {router.url}  (OpenAI API: {router.url}/v1)\n"
        f"  curl {router.url}/v1/chat/completions -H 'Content-Type: application/json'{auth} \\\n"
        f"    -d '{body}'\n"
        "Ctrl-C stops everything.",
        flush=True,
    )


class _Stop(Exception):
    pass


def _on_signal(signum, frame) -> None:
    raise _Stop()


def main(argv: list[str] | None = None) -> int:
    try:
        a = build(UpConfig, build_parser().parse_args(argv))
    except ValueError as e:
        print(f"pdserve up: {e}", file=sys.stderr)
        return 2
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="pdserve-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    token_file = log_dir / "internal-token"
    token_file.write_text(token)
    os.chmod(token_file, 0o600)
    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    children: list[Child] = []
    try:
        start_all(a, log_dir, token_file, children)
        bad = wait_healthy(children, token, a.startup_timeout)
        if bad is not None:
            state = (
                f"exited with {bad.popen.returncode}"
                if bad.popen.poll() is not None
                else "never became healthy"
            )
            print(f"\n{bad.name} {state}; last lines of {bad.log_path}:\n{bad.tail()}", file=sys.stderr)
            return 1
        _print_ready(children[0], _model_name(children[0], a.api_key_file), bool(a.api_key_file))
        sup = Supervisor(a.restart, children, log=lambda line: print(line, flush=True), now=time.monotonic())
        while True:
            c = sup.poll(time.monotonic())
            if c is not None:
                print(f"\n{c.name} exited with {c.popen.returncode}; last lines:\n{c.tail()}", file=sys.stderr)
                return 1
            time.sleep(0.25)
    except _Stop:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_IGN if s == signal.SIGINT else handler)
        stop_all(children, a.grace, on_kill=lambda c: print(f"{c.name} did not stop in {a.grace:g}s: SIGKILL",
                                                             flush=True))
        for s, handler in old.items():
            signal.signal(s, handler)
        if children:
            print(f"stopped; logs in {log_dir}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
