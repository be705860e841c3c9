"""Goodput under an SLO (DistServe's measure), PD vs colocated, over a sweep of request rates.

    python benchmarks/goodput.py --out docs/bench/goodput [--rates 0.25,0.5,1,1.5 --duration 40]

Each mode's services start once (the same as benchmarks/pd_vs_colocated.py: pd = prefill + decode +
router, pd-local = pd with conditional disaggregation, colocated = one service with both workers'
threads). Then, for each offered rate, a Poisson stream of requests runs for --duration seconds
(prompts of --input-len +- --input-std tokens, --output-len tokens out, ignore_eos), and every request
is checked against the SLO: TTFT <= --slo-ttft and TPOT <= --slo-tpot. Reported per mode and rate:
requests/s that met the SLO (goodput), the fraction that met it (attainment), TTFT and TPOT p50/p90;
and per mode, the highest offered rate whose attainment was >= --attainment (DistServe's per-GPU
goodput). Writes OUT/goodput.json, OUT/table.md and OUT/goodput.png (goodput against offered rate).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from engine.cpus import threads_per_worker as split_cpus
from engine.models.embedded import resolve_model_path
from loadtest.client import ClientConfig, fetch_model
from loadtest.metrics import SLO, fmt_ms, summarize
from loadtest.pd_vs_colocated import MODES, ExperimentConfig, add_shared_args, shared_fields, start_mode
from loadtest.report import pyplot
from loadtest.runner import ArrivalConfig, run
from loadtest.services import LocalServices
from loadtest.workload import SyntheticConfig, load_tokenizer, synthetic
from service.config import PDConfig


@dataclass(frozen=True)
class GoodputConfig:
    out_dir: str
    model: str = ""  # "" = embedded
    rates: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5)
    duration_s: float = 40.0  # per rate
    input_len: int = 256
    input_std: float = 128.0
    output_len: int = 32
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.25
    attainment: float = 0.9
    threads_per_worker: int = field(default_factory=lambda: split_cpus(2))
    modes: tuple[str, ...] = MODES
    local_prefill_threshold: int = PDConfig.local_prefill_threshold  # pd-local: the decode's default
    local_prefill_max_running: int = PDConfig.local_prefill_max_running  # pd-local: the decode's default
    local_prefill_budget: int = PDConfig.local_prefill_budget  # pd-local: the decode's default
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError("--rates must be positive numbers")
        if not 0 < self.duration_s <= 3600:
            raise ValueError("--duration must be in (0, 3600]")
        if not 0 < self.attainment <= 1:
            raise ValueError("--attainment must be in (0, 1]")
        if self.input_len < 1 or self.output_len < 2:
            raise ValueError("--input-len must be >= 1 and --output-len >= 2 (TPOT needs two tokens)")
        if not self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"--modes must be a subset of {MODES}")

    @property
    def slo(self) -> SLO:
        return SLO(ttft_s=self.slo_ttft_s, tpot_s=self.slo_tpot_s)

    def services(self) -> ExperimentConfig:
        return ExperimentConfig(out_dir=self.out_dir, model=self.model, threads_per_worker=self.threads_per_worker,
                                seed=self.seed, local_prefill_threshold=self.local_prefill_threshold,
                                local_prefill_max_running=self.local_prefill_max_running,
                                local_prefill_budget=self.local_prefill_budget)


async def sweep(url: str, cfg: GoodputConfig, tok) -> list[dict]:  # noqa: ANN001
    """One summary per rate. Every rate gets its own seeded prompts, no prompt is sent twice (a prefix
    cache would otherwise serve a repeated prompt), and each mode gets the same ones."""
    client = ClientConfig(base_url=url, model=await fetch_model(url), timeout_s=600)

    def prompts(seed: int, n: int) -> list:
        return synthetic(SyntheticConfig(n, cfg.input_len, cfg.output_len, input_len_std=cfg.input_std,
                                         seed=seed, tag="sweep"), tok)

    await run(client, ArrivalConfig(concurrency=2), prompts(cfg.seed + 999, 2))  # warm-up, discarded
    rows = []
    for i, rate in enumerate(cfg.rates):
        specs = prompts(cfg.seed + i, int(rate * cfg.duration_s * 2) + 8)  # more than the stream can take
        arrival = ArrivalConfig(request_rate=rate, duration_s=cfg.duration_s, seed=cfg.seed)
        results = await run(client, arrival, specs)
        s = summarize(results, cfg.slo)
        row = {"rate": rate, "requests": s["num_requests"], "failed": s["failed"],
               "good": s["good_requests"], "goodput": s["good_requests"] / cfg.duration_s,
               "attainment": s["goodput_fraction"], "ttft_s": s["ttft_s"], "tpot_s": s["tpot_s"],
               # per request, so another SLO can be evaluated from the JSON: [ttft, tpot] (null: failed)
               "each": [[r.ttft, r.tpot] if r.ok else None for r in results]}
        print(f"  rate {rate:g}/s: {row['good']}/{row['requests']} met the SLO "
              f"(goodput {row['goodput']:.2f}/s), {row['failed']} failed", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def max_rate(rows: list[dict], attainment: float) -> float:
    """DistServe: the highest offered rate at which the SLO attainment still reaches the target."""
    ok = [r["rate"] for r in rows if r["attainment"] >= attainment]
    return max(ok, default=0.0)


def table(cfg: GoodputConfig, by_mode: dict[str, list[dict]]) -> str:
    head = ("| mode | offered req/s | met SLO | goodput req/s | attainment | TTFT p50 | TTFT p90 "
            "| TPOT p50 | TPOT p90 | failed |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for mode, rows in by_mode.items():
        for r in rows:
            lines.append(
                f"| {mode} | {r['rate']:g} | {r['good']}/{r['requests']} | {r['goodput']:.2f} "
                f"| {r['attainment']:.0%} | {fmt_ms(r['ttft_s']['p50'])} | {fmt_ms(r['ttft_s']['p90'])} "
                f"| {fmt_ms(r['tpot_s']['p50'])} | {fmt_ms(r['tpot_s']['p90'])} | {r['failed']} |")
    best = ", ".join(f"{m} {max_rate(rows, cfg.attainment):g} req/s" for m, rows in by_mode.items())
    return (
        "\n".join(lines)
        + f"\n\nSLO: TTFT <= {cfg.slo_ttft_s * 1000:.0f} ms and TPOT <= {cfg.slo_tpot_s * 1000:.0f} ms. "
        f"Highest rate with >= {cfg.attainment:.0%} attainment: {best}. (latencies in ms)\n"
    )


def plot(path: Path, cfg: GoodputConfig, by_mode: dict[str, list[dict]]) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max(cfg.rates)
    ax.plot([0, top], [0, top], color="0.8", linestyle="--", label="offered")
    for mode, rows in by_mode.items():
        ax.plot([r["rate"] for r in rows], [r["goodput"] for r in rows], marker="o", label=mode)
    ax.set_xlabel("offered requests/s")
    ax.set_ylabel("requests/s meeting the SLO")
    ax.set_title(f"Goodput: TTFT <= {cfg.slo_ttft_s:g} s, TPOT <= {cfg.slo_tpot_s * 1000:.0f} ms")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def run_experiment(cfg: GoodputConfig) -> dict:
    model_dir = resolve_model_path(cfg.model)
    tok = load_tokenizer(model_dir)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    by_mode: dict[str, list[dict]] = {}
    for mode in cfg.modes:
        print(f"goodput: {mode}", file=sys.stderr, flush=True)
        with LocalServices(out / "logs" / mode) as svc:
            url = start_mode(svc, mode, cfg.services(), model_dir)
            by_mode[mode] = asyncio.run(sweep(url, cfg, tok))
    doc = {"config": asdict(cfg), "results": by_mode,
           "max_rate": {m: max_rate(rows, cfg.attainment) for m, rows in by_mode.items()}}
    (out / "goodput.json").write_text(json.dumps(doc, indent=1))
    (out / "table.md").write_text(table(cfg, by_mode))
    plot(out / "goodput.png", cfg, by_mode)
    return doc


def main(argv: list[str] | None = None) -> int:
    d = GoodputConfig(out_dir="")
    p = argparse.ArgumentParser(prog="benchmarks/goodput.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shared_args(p, d)
    p.add_argument("--rates", default=",".join(f"{r:g}" for r in d.rates),
                   help="offered request rates (requests/s, Poisson), comma-separated")
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load per rate")
    p.add_argument("--input-len", type=int, default=d.input_len, help="mean prompt tokens")
    p.add_argument("--input-std", type=float, default=d.input_std, help="prompt length standard deviation")
    p.add_argument("--output-len", type=int, default=d.output_len, help="output tokens per request")
    p.add_argument("--slo-ttft", type=float, default=d.slo_ttft_s, help="TTFT bound in seconds")
    p.add_argument("--slo-tpot", type=float, default=d.slo_tpot_s, help="TPOT bound in seconds")
    p.add_argument("--attainment", type=float, default=d.attainment,
                   help="share of requests that must meet the SLO for a rate to count as sustained")
    a = p.parse_args(argv)
    try:
        cfg = GoodputConfig(**shared_fields(a), rates=tuple(float(r) for r in a.rates.split(",") if r),
                            duration_s=a.duration, input_len=a.input_len, input_std=a.input_std,
                            output_len=a.output_len, slo_ttft_s=a.slo_ttft, slo_tpot_s=a.slo_tpot,
                            attainment=a.attainment)
    except ValueError as e:
        print(f"goodput: {e}", file=sys.stderr)
        return 2
    doc = run_experiment(cfg)
    print(table(cfg, doc["results"]))
    return 0

if __name__ == "__main__":
    sys.exit(main())
