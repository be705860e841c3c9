"""Weight schemes on the CPU, one run: fp32, bf16, int8 and int4 (`--quantization`) on the embedded model.

    python benchmarks/quant.py [--model embedded:smollm2-135m] [--threads N] [--schemes fp32,bf16,int8,int4]
                               [--out quant.json]

Per scheme: decode tok/s at batch 1, 16 and 64 (B prompts of 32 tokens generating N tokens each,
ignore_eos; decode time = time(generate N) - time(generate 1)), prefill tok/s of one 512-token prompt,
the model's weight bytes in memory (parameters, oneDNN-packed weights and low-bit weights with their
scales), and the teacher-forced mean log-probability per token of a fixed text (tests/engine/
test_quantize_at_load.py's) minus fp32's. Ratios are against fp32 in the same run. The load average
at start is printed and written: on a shared machine the figures move with it.

Kernel choice (engine/models/quant_cpu.py), measured per SmolLM2-135M decoder layer (qkv 960x576, o
576x576, gate_up 3072x576, down 576x1536) at batch 1, one thread, on the 2-core AMD EPYC (AVX-512) box:
oneDNN-packed fp32 0.28-0.36 ms; torch._weight_int8pack_mm 2.9 ms; _weight_int4pack_mm_for_cpu 6.2 ms
(group 32, 64 or 128 alike); the dequantize path 2.8 ms (int8) / 4.4 ms (int4); quant_cpu's C kernel
0.52 ms (int8) / 0.43 ms (int4). One layer fits the L3 cache there, which flatters fp32; the 49152x576
LM head, streamed from memory as a whole model's weights are at decode: fp32 7.9 ms, C int8 3.0 ms, C int4
2.3 ms. At 16 rows torch's kernels take 51 ms (int8) and 108 ms (int4) per layer against fp32's 1.2 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import best, prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402  (engine before torch: engine/__init__.py)
from engine.engine import LLM  # noqa: E402
from engine.models.quant import QuantTensor  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402

TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening to "
        "the waves below. Ships passed in the night, their lights blinking like distant stars, and he wrote each "
        "one in a worn leather book. In the morning he walked to the village to buy bread, milk and the paper, "
        "and the baker always asked him whether the sea had been calm.")
SCHEMES = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("float32", "int8"),
           "int4": ("float32", "int4")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m", help="HF model directory or the embedded model")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--schemes", default="fp32,bf16,int8,int4", help="comma-separated, from fp32,bf16,int8,int4")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length in tokens")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens generated per decode request")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per figure (best is kept)")
    p.add_argument("--out", default="quant.json", help="where the JSON goes")
    return p.parse_args(argv)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as held: parameters, oneDNN-packed weights, low-bit weights and their scales."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(q.nbytes() for q in model.modules() if isinstance(q, QuantTensor))
    for m in model.modules():
        for name in ("packed", "lm_packed"):
            for t in _tensors(getattr(m, name, None)):
                total += t.numel() * t.element_size()
    return total


def _tensors(v: object) -> list[torch.Tensor]:
    if isinstance(v, torch.Tensor):
        return [v]
    return [t for t in v if isinstance(t, torch.Tensor)] if isinstance(v, tuple) else []


def mean_logprob(llm: LLM, ids: list[int]) -> float:
    logp = torch.log_softmax(llm.prompt_logits(ids).float(), dim=-1)[:-1]
    return logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()


def run_scheme(a: argparse.Namespace, name: str, threads: int, batches: list[int]) -> dict:
    dtype, quantization = SCHEMES[name]
    max_b = max(batches)
    cfg = EngineConfig(model=a.model, dtype=dtype, quantization=quantization, threads=threads,
                       max_total_tokens=max(max_b * (32 + a.decode_tokens + 16) + a.prompt_len + 64, 4096),
                       max_running_requests=max_b, max_prefill_tokens=max(a.prompt_len, max_b * 32),
                       chunked_prefill_size=a.prompt_len)
    t0 = time.perf_counter()
    llm = LLM(cfg)
    load_s = time.perf_counter() - t0
    vocab = llm.runner.model_cfg.vocab_size

    def gen(ps: list[list[int]], n: int) -> None:
        out = llm.generate(ps, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
        assert all(len(c.output_ids) == n for c in out), [c.error for c in out]

    n = a.decode_tokens
    row = {"scheme": name, "dtype": dtype, "quantization": quantization, "load_s": round(load_s, 2),
           "weight_bytes": weight_bytes(llm.runner.model)}
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(llm.runner.model_path)).encode(TEXT)
    row["mean_logprob"] = mean_logprob(llm, ids)
    p = prompts(1, a.prompt_len, vocab, 1)
    row["prefill_tok_s"] = a.prompt_len / best(lambda: gen(p, 1), a.repeats)
    row["decode_tok_s"] = {}
    for b in batches:
        ps = prompts(b, 32, vocab, 100 + b)
        d = best(lambda ps=ps: gen(ps, n), a.repeats) - best(lambda ps=ps: gen(ps, 1), a.repeats)
        row["decode_tok_s"][str(b)] = b * (n - 1) / d
    print(f"{name:>5}: weights {row['weight_bytes'] / 2**20:7.1f} MiB, prefill {row['prefill_tok_s']:6.0f} tok/s, "
          "decode " + ", ".join(f"b{b} {v:6.1f}" for b, v in row["decode_tok_s"].items()) + " tok/s, "
          f"logprob {row['mean_logprob']:.4f}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    load = os.getloadavg()
    print(f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs, "
          f"{threads} threads", flush=True)
    rows = [run_scheme(a, s, threads, batches) for s in a.schemes.split(",")]
    ref = next((r for r in rows if r["scheme"] == "fp32"), None)
    if ref is not None:
        for r in rows:
            r["vs_fp32"] = {"weight_bytes": r["weight_bytes"] / ref["weight_bytes"],
                            "logprob_diff": r["mean_logprob"] - ref["mean_logprob"],
                            "prefill": r["prefill_tok_s"] / ref["prefill_tok_s"],
                            "decode": {b: v / ref["decode_tok_s"][b] for b, v in r["decode_tok_s"].items()}}
            v = r["vs_fp32"]
            print(f"{r['scheme']:>5} / fp32: weights {v['weight_bytes']:.3f}, logprob {v['logprob_diff']:+.4f} "
                  f"nats/token, prefill {v['prefill']:.2f}x, decode "
                  + ", ".join(f"b{b} {x:.2f}x" for b, x in v["decode"].items()), flush=True)
    result = {"model": a.model, "threads": threads, "host": platform.node(), "torch": torch.__version__,
              "load_average_start": load, "load_average_end": os.getloadavg(), "decode_tokens": a.decode_tokens,
              "prompt_len": a.prompt_len, "schemes": rows}
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
