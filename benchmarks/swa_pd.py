"""Sliding-window KV in PD: what the prefill sends and what the decode holds, window on vs off.

One tiny random-weight Mistral (2 layers, 2 KV heads, head_dim 16) served by a prefill role and a
decode role stepped in one process (tests/pd_harness.py: real runners, real zmq control plane, UCX
data plane by default), once with `sliding_window` = --window and once with the same weights and
the window disabled (full attention). One --prompt-tokens prompt, --gen-tokens greedy tokens.
Reported per run: KV pages and bytes transferred, the decode's KV pages held (peak, and when the
generation ends), the prefill's peak pages (peaks are allocator high-water marks, so they include
the pages a chunk holds during its forward), the pages freed as out of window; and the ratios
windowed / full. Page counts do not depend on the model's width, so the script also prices them at
Mistral-7B's geometry (32 layers, 8 KV heads, head_dim 128, bf16: 2 MiB per 16-token page).

    python benchmarks/swa_pd.py --out /tmp/swa_pd.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MISTRAL_7B_PAGE_BYTES = 32 * 2 * 16 * 8 * 128 * 2  # layers x (K,V) x tokens x kv_heads x head_dim x bf16


def run(model: Path, args: argparse.Namespace) -> dict:
    from engine.config import EngineConfig
    from engine.sampling.params import SamplingParams
    from tests.pd_harness import PDPair

    cfg = EngineConfig(model=str(model), max_total_tokens=args.prompt_tokens + args.gen_tokens + 256,
                       page_size=args.page_size, chunked_prefill_size=args.chunk, max_prefill_tokens=args.chunk,
                       host_kv_tokens=256)
    prompt = [(31 * i + 7) % 250 + 1 for i in range(args.prompt_tokens)]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.gen_tokens, ignore_eos=True)
    pair = PDPair(cfg, backend=args.backend)
    held = {"decode_at_end": 0}

    def watch(p: PDPair) -> None:
        used = p.d_kv.pool.allocator.num_used
        running = p.decode.sched.running
        if running and len(running[0].output_ids) == args.gen_tokens - 1:  # the last decode step is next
            held["decode_at_end"] = used

    t0 = time.perf_counter()
    try:
        tokens, d_done, _ = pair.run([prompt], sampling, timeout_s=600, on_step=watch)
        assert d_done["r0"].error is None, d_done["r0"].error
        assert len(tokens["r0"]) == args.gen_tokens
        held["decode_peak"] = pair.d_kv.pool.allocator.high_water  # inside steps too
        held["prefill_peak"] = pair.p_kv.pool.allocator.high_water
        page_bytes = pair.d_kv.pool.page_bytes
        nbytes = pair.decode.stats().transfer.bytes
        return {"kv_bytes_transferred": nbytes, "kv_pages_transferred": nbytes // page_bytes,
                "page_bytes": page_bytes, **{f"{k}_pages": v for k, v in held.items()},
                "window_freed_pages": {"prefill": pair.p_kv.trimmed_pages, "decode": pair.d_kv.trimmed_pages},
                "mistral7b_bytes_transferred": nbytes // page_bytes * MISTRAL_7B_PAGE_BYTES,
                "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        pair.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=256, help="sliding window of the windowed run (tokens)")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="prompt length")
    ap.add_argument("--gen-tokens", type=int, default=512, help="greedy tokens generated")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (chunked_prefill_size)")
    ap.add_argument("--backend", choices=("ucx", "fake"), default="ucx", help="KV data plane")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = ap.parse_args()

    from tests.tiny_model import make_tiny_model

    pos = args.prompt_tokens + args.gen_tokens + 64
    result: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("windowed", args.window), ("full", None)):
            model = make_tiny_model(Path(tmp) / name, model_type="mistral", sliding_window=window,
                                    max_position_embeddings=pos)
            print(f"{name}: {args.prompt_tokens}-token prompt, {args.gen_tokens} tokens ...", flush=True)
            result[name] = run(model, args)
            print(f"  {json.dumps(result[name])}", flush=True)
    w, f = result["windowed"], result["full"]
    result["ratio_windowed_over_full"] = {
        k: round(w[k] / f[k], 4) for k in ("kv_bytes_transferred", "decode_peak_pages", "decode_at_end_pages",
                                           "prefill_peak_pages")}
    print("windowed / full:", json.dumps(result["ratio_windowed_over_full"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
