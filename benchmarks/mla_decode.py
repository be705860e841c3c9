"""Time the Triton MLA decode kernel against the torch MLA attention (engine/attention/mla.py).

DeepSeek-V3 geometry: kv_lora_rank 512 + rope 64 per cached token, one latent "head" read by every
query head; 16 query heads (V3's 128 at TP 8) and 128 (TP 1). Decode: --batch sequences of --seq-len
cached tokens each (plus a batch of 1), pages shuffled in a pool of the real layout
[pages, layers, page_size, 576]. Reports per case: the max |error| vs mla_decode_torch (fp32 math),
milliseconds of both, and the latent bytes read per second by the kernel. Prints one JSON object.

Without CUDA it prints {"status": "skipped", ...} and exits 0; --smoke runs one tiny case instead
(under TRITON_INTERPRET=1 on a CPU, error only, no timing) to check the script itself.

    python benchmarks/mla_decode.py --dtype bfloat16 --out mla_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RANK, ROPE = 512, 64
LAYERS = 2  # pool layers: only the page stride matters, keep memory small


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of the queries and the latent pool")
    p.add_argument("--page-size", type=int, default=16, help="tokens per latent page")
    p.add_argument("--batch", type=int, default=64, help="decode batch size (a batch of 1 is also run)")
    p.add_argument("--seq-len", type=int, default=4096, help="cached tokens per sequence")
    p.add_argument("--heads", default="16,128", help="comma list of query head counts")
    p.add_argument("--smoke", action="store_true", help="one tiny case, also on a CPU (interpreter)")
    p.add_argument("--out", default="", help="also write the JSON here")
    return p.parse_args(argv)


def make_batch(batch: int, seq_len: int, heads: int, page_size: int, rank: int, rope: int,
               dtype: torch.dtype, device: str, gen: torch.Generator) -> tuple:
    """-> the mla_decode arguments: q_latent [B, H, R], q_pe [B, H, Dr], pool, layer, table, seq_lens,
    scale, rank; latent rows scaled like a normalised c_kv so the softmax is not one-hot."""
    need = (seq_len + page_size - 1) // page_size
    num_pages = batch * need + 1
    pool = torch.randn((num_pages, LAYERS, page_size, rank + rope), device=device, generator=gen)
    perm = torch.randperm(num_pages - 1, generator=gen, device=device) + 1
    table = perm[: batch * need].view(batch, need).to(torch.int32)
    q_latent = torch.randn((batch, heads, rank), device=device, generator=gen) * rank**-0.5
    q_pe = torch.randn((batch, heads, rope), device=device, generator=gen)
    seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=device)
    scale = (128 + rope) ** -0.5  # V3: 1/sqrt(qk_nope + qk_rope)
    return (q_latent.to(dtype), q_pe.to(dtype), pool.to(dtype), 1, table, seq_lens, scale, rank)


def bench_case(batch: int, seq_len: int, heads: int, args: argparse.Namespace, dtype: torch.dtype,
               device: str, gen: torch.Generator, rank: int = RANK, rope: int = ROPE) -> dict:
    from engine.attention.mla import mla_decode_torch
    from engine.attention.mla_triton import mla_decode_triton

    a = make_batch(batch, seq_len, heads, args.page_size, rank, rope, dtype, device, gen)
    out = mla_decode_triton(*a)
    want = mla_decode_torch(a[0].float(), a[1].float(), a[2].float(), *a[3:])
    res = {"batch": batch, "heads": heads, "seq_len": seq_len,
           "max_abs_err_vs_ref": (out.float() - want).abs().max().item()}
    if device == "cuda":
        from triton.testing import do_bench

        res["triton_ms"] = do_bench(lambda: mla_decode_triton(*a))  # as the engine calls it
        res["torch_ms"] = do_bench(lambda: mla_decode_torch(*a), rep=200)
        latent_bytes = batch * seq_len * (rank + rope) * a[2].element_size()
        res["latent_gbps"] = latent_bytes / res["triton_ms"] / 1e6
    return res


def run(args: argparse.Namespace) -> dict:
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    if args.smoke:
        cases = [bench_case(2, 37, 3, args, dtype, device, gen, rank=32, rope=16)]
    else:
        cases = [bench_case(b, args.seq_len, int(h), args, dtype, device, gen)
                 for h in args.heads.split(",") for b in sorted({1, args.batch})]
    for c in cases:
        print(" ".join(f"{k}={v:.4g}" for k, v in c.items()), flush=True)
    # bf16/fp16 outputs carry ~1e-2 relative rounding; fp32 must be near exact
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    bad = [c for c in cases if not c["max_abs_err_vs_ref"] <= tol]
    return {"status": "failed" if bad else "ok", "device": torch.cuda.get_device_name() if device == "cuda"
            else "cpu (TRITON_INTERPRET=1)", "dtype": args.dtype, "page_size": args.page_size,
            "tolerance": tol, "cases": cases}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        report = {"status": "skipped", "reason": "needs CUDA (the kernel is compiled for the GPU)"}
    else:
        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated (import)
        report = run(args)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if report["status"] == "failed" else 0


if __name__ == "__main__":
    raise SystemExit(main())
