"""`pdserve up`: router + prefill + decode (+ encoder) services on this machine, the local quick start.

1. Pick free ports, write a random internal token (workers only accept requests that carry it).
2. Start N prefill and M decode services (`python -m pdserve prefill|decode ...`), E encoder services with
   --encoder E (`pdserve encoder`: a vision-language model's vision tower, E/P/D; each with its own
   bootstrap port, registered with the router as `--encoder URL,bootstrap_port=B`, so image requests go
   encoder -> prefill -> decode) and the router, each in its own session, logs in --log-dir. On CPU each
   worker gets `--threads` = max(1, CPUs // workers) (CPUs: this process's affinity, capped by its cgroup
   quota; encoders count as workers), so the workers never run more compute threads than the machine has
   cores; `--threads`, or `--threads` inside --worker-args (--encoder-args for encoders), overrides it.
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

Worker flags are not declared here: every flag of `pdserve prefill` and `pdserve decode` that `pdserve up`
does not set itself (ports, placement, tokens) is generated from the same config fields (the "worker:"
groups below) and, when given, passed on to each worker that takes it: a flag both roles take goes to both
(--speculative: a PD pair must agree), a decode's own (--local-prefill-threshold) to the decodes only, and to
the encoders only the few `pdserve encoder` takes (model, device, dtype, image and transfer flags).
--worker-args, --prefill-args and --decode-args pass flags as written (the role's win over the others);
--worker-args goes to the prefills and decodes only (an encoder refuses the KV/scheduling flags it does not
take): encoders get --encoder-args.
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
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch  # a hard dependency, loaded anyway by the worker flags' declarations (service.config)

from common.configs import Spec, add_flags, build, option, specs, to_argv
from common.http import TOKEN_HEADER
from common.logs import add_observability_args
from common.procs import Child, free_port, http_ok, stop_all
from engine.cpus import cpu_budget, threads_per_worker
from pdserve.supervise import POLICIES, Supervisor
from service.config import PD_ROLES, server_specs

ENCODER = "encoder"  # `pdserve encoder`: E/P/D's vision encoder (vision-language models)

# worker flags `pdserve up` sets itself (by these dests), never passed on from its own command line
UP_SETS = ("host", "port", "device", "threads", "tp", "tp_devices", "dist_init_addr", "nnodes", "node_rank",
           "internal_token_file", "bootstrap_port", "advertise_host")


@dataclass(frozen=True)
class UpConfig:
    """`pdserve up`'s own flags (each field declares its flag), built from the parsed flags by name, and the
    worker flags given (`workers`, by dest). Validation raises ValueError naming the flag."""

    prefill: int = option(1, "number of prefill services")
    decode: int = option(1, "number of decode services")
    prefill_tp: int = option(1, "tensor-parallel ranks of each prefill service (its --tp: one process per rank; on "
                             "cuda each rank takes its own GPU)")
    decode_tp: int = option(1, "tensor-parallel ranks of each decode service (its --tp); may differ from "
                            "--prefill-tp")
    encoder: int = option(0, "number of encoder services (E/P/D, vision-language models only: each runs the "
                          "model's vision tower and sends the image embeddings to a prefill; image requests then go "
                          "encoder -> prefill -> decode). A text-only model's encoder exits at start-up")
    host: str = option("127.0.0.1", "router bind address (workers bind 127.0.0.1)")
    port: int = option(8000, "router port")
    device: str = option("auto", "cpu, cuda or cuda:N; with cuda and several GPUs, one GPU per worker")
    prefill_policy: str = option("least_load", "router policy for prefill workers")
    decode_policy: str = option("least_load", "router policy for decode workers")
    api_key_file: str | None = option(None, "client API keys for the router (one per line)")
    threads: int = option(
        0, "torch CPU threads per worker rank (0: divide this machine's CPUs among the ranks, max(1, CPUs // "
        "(prefill * prefill_tp + decode * decode_tp + encoder)), CPUs from the affinity mask capped by the cgroup "
        "quota; not passed when the workers compute on a GPU)")
    worker_args: str = option("", "extra flags for every prefill and decode worker, one shell-quoted string (not "
                              "for the encoders, which take few flags: --encoder-args)")
    prefill_args: str = option("", "extra flags for the prefill workers only, one shell-quoted string")
    decode_args: str = option("", "extra flags for the decode workers only, one shell-quoted string (e.g. "
                              "'--local-prefill-threshold 0' to disaggregate every prompt)")
    encoder_args: str = option("", "extra flags for the encoder workers only, one shell-quoted string (only "
                               "flags `pdserve encoder --help` lists, e.g. '--image-transfer-tokens 65536')")
    otlp_endpoint: str = ""  # common.logs' flags: passed to the router and every worker
    log_format: str = "text"
    startup_timeout: float = option(900.0, "seconds to wait for everything to be healthy")
    grace: float = option(10.0, "seconds between SIGTERM and SIGKILL when stopping")
    restart: str = option(
        "on-failure", "on-failure: restart a child (worker or router) that exits non-zero, with backoff 1, 2, 4 ... "
        "30 s (reset after 60 s up), same flags and ports; never: the first exit stops everything (exit 1)",
        choices=POLICIES)
    log_dir: str | None = option(None, "where the children's logs go (default: a new temp dir)")
    worker_cmd: str = option(f"{shlex.quote(sys.executable)} -m pdserve", "command that runs a worker, followed by "
                             "its role and flags (default: this python -m pdserve)")
    workers: Mapping[str, Any] = field(default_factory=dict)  # the worker flags given, by dest

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError("--prefill and --decode must be >= 1")
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError("--prefill-tp and --decode-tp must be >= 1")
        if self.encoder < 0:
            raise ValueError("--encoder must be >= 0")
        if self.threads < 0:
            raise ValueError("--threads must be >= 0 (0: divide the CPUs among the workers)")


def worker_specs() -> list[Spec]:
    """The worker flags `pdserve up` takes: every prefill, decode and encoder flag it does not set itself, each
    once, with no parser default (a flag not given is absent and left to the worker's own default)."""
    seen: dict[str, Any] = {}
    for role in (*PD_ROLES, ENCODER):
        for s in server_specs(role, default=argparse.SUPPRESS):
            if s.dest not in UP_SETS:
                seen.setdefault(s.dest, s)
    return list(seen.values())


def build_parser() -> argparse.ArgumentParser:
    """`pdserve up`'s parser: its own flags, the observability flags, then the workers' (generated)."""
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, list(specs(UpConfig)))
    add_observability_args(p)  # --otlp-endpoint, --log-format: passed to the router and every worker
    add_flags(p, worker_specs(), title_prefix="worker: ")
    return p


def config_from_args(ns: argparse.Namespace) -> UpConfig:
    """UpConfig from the parsed flags by name; the worker flags given go to `workers`."""
    return build(UpConfig, ns, workers={s.dest: getattr(ns, s.dest) for s in worker_specs() if hasattr(ns, s.dest)})


def _devices(device: str, n: int) -> list[str]:
    if device != "cuda":
        return [device] * n
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
        return torch.cuda.is_available()
    return device.startswith("cuda")


def _ranks(a: UpConfig) -> int:
    """Compute processes of all the workers: each prefill/decode rank, each encoder (no --tp)."""
    return a.prefill * a.prefill_tp + a.decode * a.decode_tp + a.encoder


def worker_threads(a: UpConfig, extra: list[str]) -> int | None:
    """`--threads` for each worker: None when the user set it in `extra` (--worker-args, or --encoder-args for
    the encoders) or the workers use a GPU."""
    if any(x == "--threads" or x.startswith("--threads=") for x in extra):
        return None
    if a.threads:
        return a.threads
    if _uses_gpu(a.device):
        return None
    return threads_per_worker(_ranks(a))


def _observability_flags(a: UpConfig) -> list[str]:
    flags = ["--log-format", a.log_format]
    return flags + ["--otlp-endpoint", a.otlp_endpoint] if a.otlp_endpoint else flags


def role_flags(a: UpConfig, role: str) -> list[str]:
    """The worker flags given to `pdserve up` that a `role` worker takes, as its command-line words."""
    return to_argv(server_specs(role), a.workers)


def _spawn(name: str, argv: list[str], url: str, log_dir: Path) -> Child:
    child = Child(name, argv, log_dir / f"{name}.log", url=url)
    print(f"started {name} pid {child.pid}: {url} (log {child.log_path})", flush=True)
    return child


def _extra_args(a: UpConfig) -> dict[str, list[str]]:
    """The words every worker of a role gets after its placement: --worker-args (prefill and decode only), the
    observability flags and --threads (unless that role's extra args set it), the role's generated flags, then
    its --<role>-args as written (last: they win)."""
    obs = _observability_flags(a)
    pd_extra = shlex.split(a.worker_args) + obs
    enc_args = shlex.split(a.encoder_args)
    out: dict[str, list[str]] = {}
    for role, common, own in (("prefill", pd_extra, shlex.split(a.prefill_args)),
                              ("decode", pd_extra, shlex.split(a.decode_args)), (ENCODER, obs, enc_args)):
        threads = worker_threads(a, common if role != ENCODER else enc_args)
        out[role] = [*common, *(["--threads", str(threads)] if threads is not None else []), *role_flags(a, role),
                     *own]
    return out


def start_all(a: UpConfig, log_dir: Path, token_file: Path, children: list[Child]) -> None:
    """Spawn the workers, then the router, into `children` (kept in stop order: router first), so a
    signal in the middle still leaves every started child in the list."""
    base = shlex.split(a.worker_cmd)
    extra = _extra_args(a)
    threads = worker_threads(a, shlex.split(a.worker_args))
    if threads is not None:
        print(f"each worker rank computes with --threads {threads} ({cpu_budget()} CPUs, {_ranks(a)} ranks)",
              flush=True)
    roles = ["prefill"] * a.prefill + ["decode"] * a.decode + [ENCODER] * a.encoder
    tps = [{"prefill": a.prefill_tp, "decode": a.decode_tp}.get(role, 1) for role in roles]
    router_workers: list[str] = []
    counts: dict[str, int] = {}
    for role, placement in zip(roles, _tp_flags(a.device, tps)):
        port = free_port()
        argv = [*base, role, "--port", str(port), *placement, "--internal-token-file", str(token_file),
                *extra[role]]
        url = f"http://127.0.0.1:{port}"
        if role == "decode":
            router_workers += ["--decode", url]
        else:  # a prefill's (or an encoder's) bootstrap server: decodes (or prefills) connect there
            bootstrap_port = free_port()
            argv += ["--bootstrap-port", str(bootstrap_port)]
            router_workers += [f"--{role}", f"{url},bootstrap_port={bootstrap_port}"]
        index = counts[role] = counts.get(role, -1) + 1
        children.append(_spawn(f"{role}-{index}", argv, url, log_dir))
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
        a = config_from_args(build_parser().parse_args(argv))
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
