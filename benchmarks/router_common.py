"""Pieces the router benchmarks share: null workers, the routers under test, a cheap load client.

Routers under test, each its own process, all started before a run and measured interleaved:
- `ours`: this checkout's `router.main` (optionally also with `--workers N`),
- `--baseline LABEL=TREE`: `router.main` from another source tree (e.g. `git archive main`),
- `--sglang-router PYTHON`: sglang-router (`python -m sglang_router.launch_router --pd-disaggregation`)
  run by that interpreter, kept in its own venv (never a pdserve dependency); skipped with a message
  when the interpreter is missing or lacks the package.
The load client is router.http1 (keep-alive connections, httptools parsing): a heavier client (httpx)
takes CPU from the processes under test on a small machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.procs import free_port  # noqa: E402
from router.http1 import Pool  # noqa: E402


def spawn(args: list[str], pythonpath: Path = ROOT, python: str = sys.executable) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.Popen(
        [python, *args], cwd=pythonpath, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def wait_ok(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sglang-router",
        default="/tmp/sglr-venv/bin/python",
        metavar="PYTHON",
        help="python of a venv with sglang-router installed (column skipped when absent)",
    )
    p.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="LABEL=TREE",
        help="also measure router.main from source tree TREE as column LABEL (repeatable)",
    )
    p.add_argument("--ours-workers", type=int, default=1, help="also measure this checkout with --workers N (N > 1)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per level (targets alternate)")


@dataclass
class Target:
    label: str
    url: str  # base URL
    proc: subprocess.Popen | None = None
    health: str = "/health"


@dataclass
class Bench:
    """Null prefill + decode and the routers in front of them; `targets[0]` is direct to decode."""

    null_args: list[str]  # the benchmark script's child mode, without the ROLE:PORT value
    procs: list[subprocess.Popen] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def start(self, ns: argparse.Namespace) -> None:
        pp, dp = free_port(), free_port()
        nulls = [spawn([*self.null_args, f"prefill:{pp}"]), spawn([*self.null_args, f"decode:{dp}"])]
        self.procs += nulls
        wait_ok(f"http://127.0.0.1:{pp}/health", nulls[0])
        wait_ok(f"http://127.0.0.1:{dp}/health", nulls[1])
        prefill, decode = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"
        self.targets.append(Target("direct", decode))
        ours = ["-m", "router.main", "--prefill", prefill, "--decode", decode, "--log-level", "warning"]
        for spec in ns.baseline:
            label, _, tree = spec.partition("=")
            self._add(label, [*ours, "--port"], Path(tree).resolve())
        self._add("ours", [*ours, "--port"], ROOT)
        if ns.ours_workers > 1:
            self._add(f"ours --workers {ns.ours_workers}", [*ours, "--workers", str(ns.ours_workers), "--port"], ROOT)
        self._add_sglang(ns.sglang_router, prefill, pp, decode)
        for t in self.targets[1:]:
            wait_ok(t.url + t.health, t.proc)

    def _add(self, label: str, args: list[str], tree: Path, python: str = sys.executable) -> None:
        port = free_port()
        proc = spawn([*args, str(port)], pythonpath=tree, python=python)
        self.procs.append(proc)
        self.targets.append(Target(label, f"http://127.0.0.1:{port}", proc))

    def _add_sglang(self, python: str, prefill: str, bootstrap_port: int, decode: str) -> None:
        ok = (
            Path(python).exists()
            and subprocess.run([python, "-c", "import sglang_router"], capture_output=True).returncode == 0
        )
        if not ok:
            self.skipped.append(f"sglang-router: {python} missing or without sglang_router (pip install sglang-router)")
            print(f"skipping the sglang-router column: {self.skipped[-1]}", file=sys.stderr)
            return
        args = ["-m", "sglang_router.launch_router", "--pd-disaggregation", "--host", "127.0.0.1"]
        args += ["--prefill", prefill, str(bootstrap_port), "--decode", decode, "--log-level", "warn", "--port"]
        self._add("sglang-router", args, ROOT, python=python)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def interleaved(bench: Bench, rounds: int, run_one) -> dict[str, list[dict]]:
    """`run_one(target)` per target per round, the order rotating each round; results by label."""
    out: dict[str, list[dict]] = {t.label: [] for t in bench.targets}
    for r in range(rounds):
        order = bench.targets[r % len(bench.targets) :] + bench.targets[: r % len(bench.targets)]
        for t in order:
            cpu0 = cpu_seconds(t.proc)
            res = asyncio.run(run_one(t))
            res["router_cpu_s"] = cpu_seconds(t.proc) - cpu0
            out[t.label].append(res)
    return out


def client_pool(concurrency: int) -> Pool:
    return Pool(None, connect_timeout_s=10.0, read_timeout_s=60.0, max_idle=concurrency)


def load_average() -> list[float]:
    return list(os.getloadavg())


def cpu_seconds(proc: subprocess.Popen | None) -> float:
    """User + system CPU seconds used so far by `proc` and its live descendants (Linux /proc; 0 elsewhere).
    Unlike latency, CPU per request hardly changes with the other load on the machine."""
    if proc is None or not Path("/proc/self/stat").exists():
        return 0.0
    stats: dict[int, tuple[int, float]] = {}  # pid -> (ppid, cpu s)
    tick = os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(d.name)] = (int(f[1]), (int(f[11]) + int(f[12])) / tick)
    total, todo = 0.0, [proc.pid]
    while todo:
        pid = todo.pop()
        total += stats.get(pid, (0, 0.0))[1]
        todo += [c for c, (pp, _) in stats.items() if pp == pid]
    return total


def serve_null(spec: str, app) -> int:
    """Child process mode: serve `app(role, port)` for `spec` = ROLE:PORT."""
    import uvicorn

    role, port = spec.split(":")
    uvicorn.run(app(role, int(port)), host="127.0.0.1", port=int(port), log_level="warning")
    return 0


def run_bench(script: str, a: argparse.Namespace, measure, table) -> int:
    """Start the null workers and routers, `measure(bench)`, stop them; print `table(result)` and
    write the result (with the machine's load average before and after) to `a.out` as JSON."""
    bench = Bench([str(Path(script).resolve()), "--serve-null"])
    try:
        bench.start(a)
        load_before = load_average()
        result = measure(bench)
    finally:
        bench.stop()
    result.update(cpu_count=os.cpu_count(), load_average_before=load_before, load_average_after=load_average())
    result["skipped"] = bench.skipped
    print(table(result))
    print(f"load average before/after: {load_before} / {result['load_average_after']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return 0
