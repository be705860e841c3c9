"""PD vs colocated on the embedded model: long prompts arriving while other requests decode.

    python benchmarks/pd_vs_colocated.py --duration 60 --out docs/bench/pd_vs_colocated

Workload, the same for both modes (seeded), run for `duration` seconds:
  decode stream   `decode_concurrency` requests always in flight: short prompts, long outputs
  prefill stream  Poisson arrivals of long prompts with short outputs
In colocated mode every long prompt's prefill chunks share steps with the running decodes, so the
decode stream's inter-token latency jumps; in PD the prefill runs elsewhere and the decode only
receives KV. Reported: p50/p99 ITL of the decode stream, p50/p99 TTFT of both streams.

Modes (local processes, UCX over TCP on 127.0.0.1, equal CPU threads in total):
  pd         prefill (--threads T) + decode (--threads T) + router; the decode disaggregates every
             prompt (--local-prefill-threshold 0)
  pd-local   pd, and the decode prefills prompts of at most --local-prefill-threshold tokens itself
             (conditional disaggregation; the decode's defaults, 256 tokens in --local-prefill-budget
             32-token steps, unless given here)
  colocated  one service (--threads 2T)
Writes OUT/pd_vs_colocated.json, OUT/table.md, OUT/latency_cdf.png, OUT/itl_over_time.png, logs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from common.procs import free_port
from engine.cpus import threads_per_worker as split_cpus
from engine.models.embedded import resolve_model_path
from loadtest.client import ClientConfig, fetch_model
from loadtest.metrics import RequestResult, fmt_ms, summarize_by_tag
from loadtest.report import write_plots
from loadtest.runner import ArrivalConfig, run
from loadtest.services import ALWAYS_PD, LocalServices
from loadtest.workload import SyntheticConfig, load_tokenizer, synthetic
from service.config import PDConfig

MODES = ("pd", "pd-local", "colocated")


@dataclass(frozen=True)
class ExperimentConfig:
    out_dir: str
    model: str = ""  # "" = embedded
    duration_s: float = 60.0
    decode_concurrency: int = 4
    decode_input_len: int = 64
    decode_output_len: int = 64
    long_rate: float = 0.15  # long prompts per second (Poisson)
    long_input_len: int = 1024
    long_output_len: int = 4
    threads_per_worker: int = field(default_factory=lambda: split_cpus(2))  # CPUs split by 2 workers
    seed: int = 0
    modes: tuple[str, ...] = MODES
    ready_timeout_s: float = 300.0
    extra_service_args: tuple[str, ...] = ()
    local_prefill_threshold: int = PDConfig.local_prefill_threshold  # pd-local: the decode's flag (its default)
    local_prefill_max_running: int = PDConfig.local_prefill_max_running  # pd-local: the decode's flag (its default)
    local_prefill_budget: int = PDConfig.local_prefill_budget  # pd-local: the decode's flag (its default)

    def __post_init__(self) -> None:
        if not 0 < self.duration_s <= 3600:
            raise ValueError("--duration must be in (0, 3600]")
        if self.decode_concurrency < 1 or self.threads_per_worker < 1:
            raise ValueError("--decode-concurrency and --threads must be >= 1")
        if not self.long_rate > 0:
            raise ValueError("--long-rate must be > 0")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"--modes must be a subset of {MODES}")


def start_mode(svc: LocalServices, mode: str, cfg: ExperimentConfig, model_dir: Path) -> str:
    """Start one mode's services; returns the base URL to load."""
    common = ["--model", str(model_dir), "--host", "127.0.0.1", "--device", "cpu", "--dtype", "float32",
              "--seed", str(cfg.seed), *cfg.extra_service_args]
    py = [sys.executable, "-m", "pdserve"]
    t = str(cfg.threads_per_worker)
    if mode == "colocated":
        port = free_port()
        svc.spawn("colocated", py + ["colocated", *common, "--port", str(port), "--threads", str(2 * int(t))])
        url = f"http://127.0.0.1:{port}"
        svc.wait_healthy([url + "/health"], cfg.ready_timeout_s)
        return url
    pre, dec, boot, rtr = free_port(), free_port(), free_port(), free_port()
    svc.spawn("prefill", py + ["prefill", *common, "--port", str(pre), "--bootstrap-port", str(boot),
                               "--threads", t])
    local = ["--local-prefill-threshold", str(cfg.local_prefill_threshold),
             "--local-prefill-max-running", str(cfg.local_prefill_max_running),
             "--local-prefill-budget", str(cfg.local_prefill_budget)] if mode == "pd-local" else list(ALWAYS_PD)
    svc.spawn("decode", py + ["decode", *common, "--port", str(dec), "--threads", t, *local])
    workers = [f"http://127.0.0.1:{pre}/health", f"http://127.0.0.1:{dec}/health"]
    svc.wait_healthy(workers, cfg.ready_timeout_s)
    svc.spawn("router", py + ["router", "--host", "127.0.0.1", "--port", str(rtr),
                              "--prefill", f"http://127.0.0.1:{pre},bootstrap_port={boot}",
                              "--decode", f"http://127.0.0.1:{dec}"])
    url = f"http://127.0.0.1:{rtr}"
    svc.wait_healthy([url + "/health"], cfg.ready_timeout_s)
    return url


async def mixed_load(url: str, cfg: ExperimentConfig, tok) -> list[RequestResult]:  # noqa: ANN001
    """Warm up, then the decode stream and the long-prompt stream together on one clock."""
    model = await fetch_model(url)
    client = ClientConfig(base_url=url, model=model, timeout_s=600)
    dec = synthetic(SyntheticConfig(64, cfg.decode_input_len, cfg.decode_output_len, seed=cfg.seed,
                                    tag="decode"), tok)
    long = synthetic(SyntheticConfig(64, cfg.long_input_len, cfg.long_output_len, seed=cfg.seed + 1,
                                     tag="long"), tok)
    await run(client, ArrivalConfig(concurrency=2), dec[:2])  # warm-up, discarded
    t0 = time.monotonic()
    a = run(client, ArrivalConfig(concurrency=cfg.decode_concurrency, duration_s=cfg.duration_s), dec, t0=t0)
    b = run(client, ArrivalConfig(request_rate=cfg.long_rate, duration_s=cfg.duration_s, seed=cfg.seed),
            long, t0=t0, index_base=100_000)
    ra, rb = await asyncio.gather(a, b)
    return ra + rb


def table(summaries: dict[str, dict]) -> str:
    """Markdown table: one row per mode."""
    head = ("| mode | decode ITL p50 | decode ITL p99 | decode TTFT p50 | decode TTFT p99 | long TTFT p50 "
            "| long TTFT p99 | failed | out tok/s |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for mode, s in summaries.items():
        d, lg, al = s.get("decode"), s.get("long"), s["all"]
        cells = [fmt_ms(d["itl_s"]["p50"]), fmt_ms(d["itl_s"]["p99"]), fmt_ms(d["ttft_s"]["p50"]),
                 fmt_ms(d["ttft_s"]["p99"]), fmt_ms(lg["ttft_s"]["p50"]) if lg else "-",
                 fmt_ms(lg["ttft_s"]["p99"]) if lg else "-", str(al["failed"]),
                 f"{al['output_token_throughput']:.1f}"]
        rows.append(f"| {mode} | " + " | ".join(cells) + " |")
    return head + "\n" + "\n".join(rows) + "\n\n(latencies in ms)\n"


def run_experiment(cfg: ExperimentConfig) -> dict:
    model_dir = resolve_model_path(cfg.model)
    tok = load_tokenizer(model_dir)
    out = Path(cfg.out_dir)
    results: dict[str, list[RequestResult]] = {}
    for mode in cfg.modes:
        with LocalServices(out / "logs" / mode) as svc:
            url = start_mode(svc, mode, cfg, model_dir)
            results[mode] = asyncio.run(mixed_load(url, cfg, tok))
    summaries = {m: summarize_by_tag(r) for m, r in results.items()}
    doc = {"config": asdict(cfg), "summaries": summaries,
           "requests": {m: [r.to_json() for r in rs] for m, rs in results.items()}}
    (out / "pd_vs_colocated.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(table(summaries))
    runs = {f"{m} {tag}": [r for r in rs if r.tag == tag]
            for m, rs in results.items() for tag in ("decode", "long")}
    write_plots(out, runs, title="PD vs colocated: decode stream + long prompts")
    return doc


def add_shared_args(p: argparse.ArgumentParser, d: ExperimentConfig | Any) -> None:
    """The flags this experiment and loadtest/goodput.py both take (`d`: a config holding the defaults):
    where to write, the model, how the services start (threads, modes, pd-local's bounds), the seed."""
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", default="", help="HF model directory (default: the embedded model)")
    p.add_argument("--threads", type=int, default=d.threads_per_worker,
                   help="torch threads per PD worker (colocated gets twice this; default: this machine's CPUs // 2)")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {','.join(MODES)}")
    p.add_argument("--local-prefill-threshold", type=int, default=d.local_prefill_threshold,
                   help="pd-local: prompts of at most this many tokens are prefilled on the decode")
    p.add_argument("--local-prefill-max-running", type=int, default=d.local_prefill_max_running,
                   help="pd-local: a short prompt is prefilled on the decode only while fewer than this many "
                        "requests are on it (0: no bound)")
    p.add_argument("--local-prefill-budget", type=int, default=d.local_prefill_budget,
                   help="pd-local: prompt tokens the decode's local prefills may add to one step")
    p.add_argument("--seed", type=int, default=0, help="workload seed")


def shared_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The config fields of the flags `add_shared_args` declared, by name."""
    return dict(out_dir=args.out, model=args.model, threads_per_worker=args.threads,
                modes=tuple(m for m in args.modes.split(",") if m), seed=args.seed,
                local_prefill_threshold=args.local_prefill_threshold,
                local_prefill_max_running=args.local_prefill_max_running,
                local_prefill_budget=args.local_prefill_budget)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/pd_vs_colocated.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = ExperimentConfig(out_dir="")
    add_shared_args(p, d)
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load per mode")
    p.add_argument("--decode-concurrency", type=int, default=d.decode_concurrency,
                   help="decode-stream requests kept in flight")
    p.add_argument("--decode-input-len", type=int, default=d.decode_input_len,
                   help="decode-stream prompt tokens")
    p.add_argument("--decode-output-len", type=int, default=d.decode_output_len,
                   help="decode-stream output tokens")
    p.add_argument("--long-rate", type=float, default=d.long_rate, help="long prompts per second (Poisson)")
    p.add_argument("--long-input-len", type=int, default=d.long_input_len, help="long prompt tokens")
    p.add_argument("--long-output-len", type=int, default=d.long_output_len, help="long-prompt output tokens")
    args = p.parse_args(argv)
    try:
        cfg = ExperimentConfig(**shared_fields(args), duration_s=args.duration,
                               decode_concurrency=args.decode_concurrency,
                               decode_input_len=args.decode_input_len,
                               decode_output_len=args.decode_output_len, long_rate=args.long_rate,
                               long_input_len=args.long_input_len, long_output_len=args.long_output_len)
    except ValueError as e:
        print(f"pd_vs_colocated: {e}", file=sys.stderr)
        return 2
    doc = run_experiment(cfg)
    print(table(doc["summaries"]))
    failed = sum(s["all"]["failed"] for s in doc["summaries"].values())
    return 0 if failed == 0 else 1

if __name__ == "__main__":
    sys.exit(main())
