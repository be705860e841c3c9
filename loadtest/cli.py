"""`pdserve bench`: async OpenAI-compatible load generator.

    pdserve bench --url http://127.0.0.1:8000 --num-requests 64 --request-rate 4 \\
        --input-len 256 --output-len 64 --slo-ttft 2 --slo-tpot 0.2 --out bench-out/

Multi-turn chat (`--conversations N --turns T --turn-len L [--system-prompt-len S]`): each turn
appends the previous reply and a new user message; TTFT, cached tokens and KV bytes are reported per
turn index (loadtest/multiturn.py).

Writes DIR/bench.json (config, summary, per-request timings), DIR/latency_cdf.png and
DIR/itl_over_time.png, and prints a summary. Exit status 0 when every request completed, 1 when
some failed, 2 on bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from common.secrets import read_secret
from loadtest.client import ENDPOINTS, ClientConfig, fetch_model
from loadtest.metrics import SLO, summarize
from loadtest.multiturn import MultiTurnConfig, run_multi_turn, turn_table
from loadtest.report import text_summary, write_json, write_plots
from loadtest.runner import ArrivalConfig, Progress, run
from loadtest.workload import SyntheticConfig, load_tokenizer, sharegpt, synthetic


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="router or service base URL")
    p.add_argument("--endpoint", default="completions", choices=sorted(ENDPOINTS),
                   help="OpenAI API to drive: completions (exact prompt tokens) or chat")
    p.add_argument("--model", default=None, help="model name in the bodies (default: first of /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="HF directory with tokenizer.json, for exact prompt token counts (default: embedded)")
    p.add_argument("--num-requests", type=int, default=100,
                   help="requests to send (with --duration: distinct prompts, cycled)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (inf: all at once)")
    p.add_argument("--concurrency", type=int, default=None, help="max requests in flight (default: no cap)")
    p.add_argument("--duration", type=float, default=None,
                   help="seconds to keep issuing requests (cycling the prompts); bounds the run")
    p.add_argument("--input-len", type=int, default=256, help="mean synthetic prompt length in tokens")
    p.add_argument("--input-len-std", type=float, default=0.0,
                   help="std of the prompt length (normal, truncated to [1, 2*mean]); 0 = fixed")
    p.add_argument("--output-len", type=int, default=None,
                   help="output tokens per request (default 128; with --dataset: the reply's length)")
    p.add_argument("--output-len-std", type=float, default=0.0, help="std of the output length; 0 = fixed")
    p.add_argument("--dataset", default=None, help="ShareGPT-format JSON file instead of synthetic prompts")
    p.add_argument("--conversations", type=int, default=0,
                   help="multi-turn chat workload: this many conversations, run in lockstep turns (0: off; "
                        "then --num-requests, --input-len and --dataset are not used)")
    p.add_argument("--turns", type=int, default=6, help="multi-turn: turns per conversation")
    p.add_argument("--turn-len", type=int, default=200, help="multi-turn: tokens of each new user message")
    p.add_argument("--system-prompt-len", type=int, default=0,
                   help="multi-turn: tokens of a system prompt shared by every conversation (0: none)")
    p.add_argument("--kv-metrics-url", action="append", default=[],
                   help="multi-turn: a PD worker URL (repeatable) whose pdserve_worker_transfer_bytes_total is "
                        "read before and after each turn, for KV bytes transferred per request (give the "
                        "decodes, or the prefills: not both)")
    p.add_argument("--internal-token-file", default=None,
                   help="file with the cluster's internal token, for --kv-metrics-url workers")
    p.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds, for goodput")
    p.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds, for goodput")
    p.add_argument("--out", default=None, help="directory for bench.json and the PNG plots")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos (outputs may end early at EOS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def make_specs(args: argparse.Namespace):
    tok = load_tokenizer(args.tokenizer)
    if args.dataset:
        return sharegpt(args.dataset, tok, args.num_requests, args.seed, args.output_len)
    cfg = SyntheticConfig(num_requests=args.num_requests, input_len=args.input_len,
                          output_len=args.output_len or 128, input_len_std=args.input_len_std,
                          output_len_std=args.output_len_std, seed=args.seed)
    return synthetic(cfg, tok)


async def bench_multi_turn(args: argparse.Namespace) -> dict:
    mt = MultiTurnConfig(conversations=args.conversations, turns=args.turns, turn_len=args.turn_len,
                         output_len=args.output_len or 64, system_len=args.system_prompt_len, seed=args.seed)
    ArrivalConfig(concurrency=args.concurrency)  # validates the flag
    tok = load_tokenizer(args.tokenizer)
    model = args.model or await fetch_model(args.url, args.api_key)
    cfg = ClientConfig(base_url=args.url, model=model, endpoint=args.endpoint, api_key=args.api_key,
                       timeout_s=args.timeout, ignore_eos=not args.no_ignore_eos)
    token = read_secret(args.internal_token_file)
    progress = Progress(mt.conversations * mt.turns, enabled=not args.no_progress)
    try:
        results, rows = await run_multi_turn(cfg, mt, tok, args.concurrency, args.kv_metrics_url, token, progress)
    finally:
        progress.close()
    config = {"client": asdict(cfg) | {"api_key": bool(cfg.api_key)}, "multi_turn": asdict(mt),
              "concurrency": args.concurrency, "kv_metrics_urls": args.kv_metrics_url}
    return {"config": config, "summary": summarize(results) | {"by_turn": rows}, "results": results}


async def bench(args: argparse.Namespace) -> dict:
    """Run the bench described by parsed flags; returns the JSON document's parts."""
    if args.conversations:
        return await bench_multi_turn(args)
    arrival = ArrivalConfig(request_rate=args.request_rate, concurrency=args.concurrency,
                            duration_s=args.duration, seed=args.seed)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    ClientConfig(base_url=args.url, model="-", endpoint=args.endpoint, timeout_s=args.timeout)
    specs = make_specs(args)
    model = args.model or await fetch_model(args.url, args.api_key)
    cfg = ClientConfig(base_url=args.url, model=model, endpoint=args.endpoint, api_key=args.api_key,
                       timeout_s=args.timeout, ignore_eos=not args.no_ignore_eos)
    total = None if args.duration else len(specs)
    progress = Progress(total, enabled=not args.no_progress)
    try:
        results = await run(cfg, arrival, specs, progress, t0=time.monotonic())
    finally:
        progress.close()
    config = {"client": asdict(cfg) | {"api_key": bool(cfg.api_key)}, "arrival": asdict(arrival),
              "dataset": args.dataset, "input_len": args.input_len, "input_len_std": args.input_len_std,
              "output_len": args.output_len, "num_specs": len(specs)}
    return {"config": config, "summary": summarize(results, slo), "results": results}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        doc = asyncio.run(bench(args))
    except (ValueError, httpx.HTTPError) as e:
        print(f"pdserve bench: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130
    print(text_summary(doc["summary"]))
    if "by_turn" in doc["summary"]:
        print(turn_table(doc["summary"]["by_turn"]))
    if args.out:
        out = Path(args.out)
        write_json(out / "bench.json", doc["config"], doc["summary"], doc["results"])
        write_plots(out, {"bench": doc["results"]}, title=args.url)
        print(f"wrote {out}/bench.json, latency_cdf.png, itl_over_time.png")
    return 0 if doc["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
