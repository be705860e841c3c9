"""Time the Triton paged-attention kernels against dense torch SDPA and the paged torch reference.

Shapes (defaults): the embedded SmolLM2 attention (9 query heads, 3 KV heads, head_dim 64) and a
Llama-3-8B-like one (32/8/128). Decode: --batch requests of --seq-len cached tokens. Extend:
--extend-batch requests of --seq-len new tokens, half of them after a prefix of --seq-len // 2.
The pool has the real layout [P, L, 2, page_size, Hkv, D] with pages shuffled; SDPA gets the same
K/V already dense and contiguous (its best case). Prints one JSON object; on a machine without
CUDA it prints {"status": "skipped", ...} and exits 0.

    python benchmarks/attention_kernels.py --dtype bfloat16 --out attention.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.attention.base import AttentionMetadata, build_metadata  # noqa: E402
from engine.attention.torch_ref import TorchAttention  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}  # (Hq, Hkv, D)
LAYERS = 4  # pool layers: only the page stride matters, keep memory small


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of q and the KV pool")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--batch", type=int, default=64, help="decode batch size")
    p.add_argument("--extend-batch", type=int, default=4, help="requests in the extend batch")
    p.add_argument("--seq-len", type=int, default=1024, help="cached tokens per decode request "
                   "and new tokens per extend request")
    p.add_argument("--shapes", default="smollm2,llama8b", help="comma list of: " + ",".join(SHAPES))
    p.add_argument("--skip-reference", action="store_true",
                   help="do not time the paged torch reference (it loops in Python)")
    p.add_argument("--out", default="", help="also write the JSON here")
    return p.parse_args(argv)


def make_batch(seq_lens: list[int], q_lens: list[int], shape: tuple[int, int, int], page_size: int,
               dtype: torch.dtype, gen: torch.Generator) -> tuple:
    """-> q [T, Hq, D], k/v layer views [P, ps, Hkv, D], meta, dense k/v [B, Hkv, S, D] (if equal)."""
    hq, hkv, d = shape
    need = [(s + page_size - 1) // page_size for s in seq_lens]
    num_pages = sum(need) + 1
    pool = torch.randn((num_pages, LAYERS, 2, page_size, hkv, d), device="cuda", dtype=dtype,
                       generator=gen)
    perm = (torch.randperm(num_pages - 1, generator=gen, device="cuda") + 1).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    q = torch.randn((sum(q_lens), hq, d), device="cuda", dtype=dtype, generator=gen)
    meta = build_metadata(tables, seq_lens, q_lens, page_size, d**-0.5, "cuda")
    k_pages, v_pages = pool[:, 1, 0], pool[:, 1, 1]
    return q, k_pages, v_pages, meta


def dense_kv(pages: torch.Tensor, meta: AttentionMetadata, seq_len: int) -> torch.Tensor:
    """Paged [P, ps, Hkv, D] -> dense [B, Hkv, S, D] for requests of equal length."""
    need = (seq_len + meta.page_size - 1) // meta.page_size
    idx = meta.page_table[:, :need].long()  # [B, need]
    b, hkv, d = idx.shape[0], pages.shape[2], pages.shape[3]
    return pages[idx].reshape(b, -1, hkv, d)[:, :seq_len].transpose(1, 2).contiguous()


def bench_case(kind: str, shape, args, dtype, gen) -> dict:
    from triton.testing import do_bench

    from engine.attention.triton_backend import TritonAttention

    s = args.seq_len
    if kind == "decode":
        seq_lens, q_lens = [s] * args.batch, [1] * args.batch
    else:
        n = args.extend_batch
        seq_lens = [s if i % 2 == 0 else s + s // 2 for i in range(n)]
        q_lens = [s] * n
    q, k_pages, v_pages, meta = make_batch(seq_lens, q_lens, shape, args.page_size, dtype, gen)
    triton_attn, ref = TritonAttention(), TorchAttention()
    out = triton_attn.forward(q, k_pages, v_pages, meta)
    want = ref.forward(q.float(), k_pages.float(), v_pages.float(), meta)
    res = {"kind": kind, "shape": dict(zip(("hq", "hkv", "d"), shape)), "seq_lens": seq_lens[:4],
           "q_lens": q_lens[:4], "batch": len(seq_lens),
           "max_abs_err_vs_ref": (out.float() - want).abs().max().item()}
    res["triton_ms"] = do_bench(lambda: triton_attn.forward(q, k_pages, v_pages, meta))
    # dense SDPA on the same problem without pages: decode is exact, extend uses the no-prefix case
    b, hq = len(seq_lens), shape[0]
    if kind == "decode":
        k = dense_kv(k_pages, meta, s)
        v = dense_kv(v_pages, meta, s)
        qd = q.view(b, 1, hq, -1).transpose(1, 2)  # [B, Hq, 1, D]
        dense = F.scaled_dot_product_attention(qd, k, v, enable_gqa=True)  # [B, Hq, 1, D]
        res["max_abs_err_vs_sdpa"] = (dense.transpose(1, 2).reshape_as(out) - out).abs().max().item()
        res["sdpa_ms"] = do_bench(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True))
        kv_bytes = 2 * sum(seq_lens) * shape[1] * shape[2] * q.element_size()
        res["triton_kv_gbps"] = kv_bytes / res["triton_ms"] / 1e6
    else:
        qd = torch.randn((b, hq, s, shape[2]), device="cuda", dtype=dtype, generator=gen)
        k = torch.randn((b, shape[1], s, shape[2]), device="cuda", dtype=dtype, generator=gen)
        v = torch.randn_like(k)
        res["sdpa_ms_no_prefix"] = do_bench(
            lambda: F.scaled_dot_product_attention(qd, k, v, is_causal=True, enable_gqa=True))
    if not args.skip_reference:
        res["torch_ref_ms"] = do_bench(lambda: ref.forward(q, k_pages, v_pages, meta), rep=200)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        report = {"status": "skipped", "reason": "needs CUDA (Triton kernels are compiled for the GPU)"}
    else:
        dtype = getattr(torch, args.dtype)
        gen = torch.Generator(device="cuda").manual_seed(0)
        cases = []
        for name in args.shapes.split(","):
            for kind in ("decode", "extend"):
                case = bench_case(kind, SHAPES[name], args, dtype, gen)
                case["model"] = name
                cases.append(case)
                print(f"{name:8s} {kind:6s} " + " ".join(
                    f"{k}={v:.4g}" for k, v in case.items() if isinstance(v, float)), flush=True)
        # bf16/fp16 outputs of N(0,1) values carry ~1e-2 rounding; fp32 must be near exact
        tol = 1e-3 if dtype == torch.float32 else 5e-2
        bad = [c for c in cases if not c["max_abs_err_vs_ref"] <= tol]
        report = {"status": "failed" if bad else "ok", "device": torch.cuda.get_device_name(),
                  "dtype": args.dtype, "page_size": args.page_size, "tolerance": tol, "cases": cases}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if report["status"] == "failed" else 0


if __name__ == "__main__":
    raise SystemExit(main())
