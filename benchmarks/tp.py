"""Tensor parallelism on the CPU: step time TP=2 vs TP=1, the KV staging cost, and KV bytes per rank.

1. Step time of one random-weight Llama (default: 4 layers, hidden 512, 8 heads, 4 KV heads,
   intermediate 1408, vocab 8192, fp32) for a prefill step (one 512-token extend) and a decode step
   (a batch of 16 requests, 1 token each at position 256), as `ModelRunner.forward` on rank 0:
     tp1_t1  TP=1, 1 thread;  tp1_t2  TP=1, 2 threads (the cores TP=2 uses);  tp2  TP=2, 1 thread per
     rank (two processes, gloo all-reduce). On a 2-core box TP=2 shows the cost of the collectives
     and the rank broadcast, not a speed-up: the same 2 cores run one process with 2 threads as well.
   Also, under TP=2: `kv_gather` of the 512-token prompt's pages (the prefill's staging before a
   send) and `kv_scatter` of them (the decode's, after a receive), engine/distributed/tp_kv.py.
2. KV bytes per rank of one prompt for every (prefill TP, decode TP) pair in {1, 2, 4}^2, for this
   model and priced at Llama-3.1-70B's geometry: the wire carries full pages (all KV heads) from the
   prefill's rank 0 to the decode's rank 0; a TP > 1 prefill first gathers each other rank's heads
   into rank 0, a TP > 1 decode then scatters each other rank its heads (replicated ones to every
   holder). Computed from the layout the code moves (engine/distributed/tp_kv.py head_slices); "direct" is what a
   decode rank would receive if prefill ranks sent each decode rank its heads directly instead.

    python benchmarks/tp.py --out docs/bench/tp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA70B = {"layers": 80, "kv_heads": 8, "head_dim": 128, "itemsize": 2, "page_size": 16}  # bf16


def make_model(dst: Path, args: argparse.Namespace) -> Path:
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(dst, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                           max_position_embeddings=4096, eos_token_id=args.vocab - 1)


def _median_ms(fn, repeats: int) -> float:  # noqa: ANN001 - a zero-argument callable
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000, 2)


def step_times(model: Path, tp: int, threads: int, args: argparse.Namespace) -> dict:
    """Median prefill and decode step times (ms) of ModelRunner.forward, and under TP the KV staging."""
    from engine.config import EngineConfig
    from engine.distributed import tp_kv, tp_ranks
    from engine.distributed.tp_runner import make_runner
    from engine.forward.forward_batch import LOGITS_LAST, Segment, forward_segments

    ps = 16
    cfg, _store = tp_ranks.host_rendezvous(EngineConfig(
        model=str(model), device="cpu", threads=threads, page_size=ps, tp=tp,
        max_total_tokens=args.prefill_tokens + 16 * 272 + 4 * ps, host_kv_tokens=64))
    procs = tp_ranks.spawn_ranks(cfg) if tp > 1 else []
    runner = make_runner(cfg)
    try:
        alloc = runner.pool.allocator
        n = args.prefill_tokens
        prompt = [(7 * i + 3) % (args.vocab - 1) for i in range(n)]
        p_pages = alloc.allocate(-(-n // ps))
        prefill = _median_ms(lambda: forward_segments(runner, [Segment(p_pages, 0, prompt, LOGITS_LAST)]), args.repeats)
        ctx = 256
        d_pages = [alloc.allocate(ctx // ps + 1) for _ in range(args.batch)]
        segs = [Segment(pages, ctx, [5 + i], LOGITS_LAST) for i, pages in enumerate(d_pages)]
        decode = _median_ms(lambda: forward_segments(runner, segs), args.repeats * 4)
        out = {"prefill_step_ms": prefill, "decode_step_ms": decode, "threads_per_rank": threads, "ranks": tp}
        if tp > 1:
            wire = tp_kv.gather(runner, p_pages)
            out["kv_gather_ms"] = _median_ms(lambda: tp_kv.gather(runner, p_pages), args.repeats)
            out["kv_scatter_ms"] = _median_ms(lambda: tp_kv.scatter(runner, p_pages, wire), args.repeats)
            out["staged_bytes"] = wire.numel()
        return out
    finally:
        runner.close()
        for p in procs:
            p.join(30)


def bytes_per_rank(pages: int, page_bytes: int, heads: int, tp_p: int, tp_d: int) -> dict:
    """One prompt of `pages` wire pages (all `heads` KV heads) from a TP tp_p prefill to a TP tp_d decode."""
    from engine.distributed.tp_kv import head_slices

    per_head = page_bytes // heads * pages
    p_slices, d_slices = head_slices(heads, tp_p), head_slices(heads, tp_d)
    # prefill: rank r > 0 sends its shard to rank 0 (gather; skipped when rank 0 holds every head)
    gather = [0] + [c * per_head if p_slices[0][1] < heads else 0 for _, c in p_slices[1:]]
    scatter = [0] + [c * per_head for _, c in d_slices[1:]]  # decode: rank 0 -> rank r > 0
    return {"wire_bytes_prefill_rank0_to_decode_rank0": pages * page_bytes,
            "gather_bytes_sent_by_prefill_rank": gather, "scatter_bytes_received_by_decode_rank": scatter,
            "direct_bytes_received_by_decode_rank": [c * per_head for _, c in d_slices]}


def pair_table(pages: int, page_bytes: int, heads: int) -> dict:
    return {f"P{tp_p}->D{tp_d}": bytes_per_rank(pages, page_bytes, heads, tp_p, tp_d)
            for tp_p in (1, 2, 4) for tp_d in (1, 2, 4) if heads % min(tp_p, heads) == 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--prefill-tokens", type=int, default=512, help="tokens of the prefill step's extend")
    ap.add_argument("--batch", type=int, default=16, help="requests in the decode step")
    ap.add_argument("--repeats", type=int, default=5, help="timed prefill steps (decode: 4x as many)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()
    result: dict = {"load_average_1m_5m_15m_at_start": [round(x, 2) for x in os.getloadavg()],
                    "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads",
                                                            "intermediate", "vocab")}, "steps": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", args)
        for name, tp, threads in (("tp1_t1", 1, 1), ("tp1_t2", 1, 2), ("tp2", 2, 1)):
            result["steps"][name] = step_times(model, tp, threads, args)
            print(name, json.dumps(result["steps"][name]), flush=True)
    s = result["steps"]
    for base in ("tp1_t1", "tp1_t2"):
        result[f"tp2_over_{base}"] = {k: round(s["tp2"][k] / s[base][k], 2)
                                      for k in ("prefill_step_ms", "decode_step_ms")}
    result["load_average_1m_5m_15m_at_end"] = [round(x, 2) for x in os.getloadavg()]
    head_dim = args.hidden // args.heads
    pages = -(-args.prefill_tokens // 16)
    result["kv_bytes_per_rank"] = {
        "prompt_tokens": args.prefill_tokens,
        "this_model": pair_table(pages, args.layers * 2 * 16 * args.kv_heads * head_dim * 4, args.kv_heads),
        "llama_3_1_70b_bf16": pair_table(pages, LLAMA70B["layers"] * 2 * 16 * LLAMA70B["kv_heads"]
                                         * LLAMA70B["head_dim"] * LLAMA70B["itemsize"], LLAMA70B["kv_heads"]),
    }
    print("TP2 / TP1 (1 thread):", json.dumps(result["tp2_over_tp1_t1"]),
          "TP2 / TP1 (2 threads):", json.dumps(result["tp2_over_tp1_t2"]))
    print("P2->D4 (this model):", json.dumps(result["kv_bytes_per_rank"]["this_model"]["P2->D4"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
