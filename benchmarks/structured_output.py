"""Structured output cost: decode tok/s at batch B with a json_schema constraint vs unconstrained, in
the same run, same engine, same prompts (issue 16 part 5).

    python benchmarks/structured_output.py [--model embedded:smollm2-135m] [--batch 16] [--out FILE]

Both runs are greedy with ignore_eos and generate exactly --decode-tokens tokens per request: the
schema (an array of at least 200 small records) cannot end sooner. Decode time = time(generate N) -
time(generate 1), so prefill is not counted; tok/s = B * (N - 1) / decode time (best of --repeats).
The constrained figure includes everything grammar rows cost: the per-row CPU copy, the matcher's
bitmask fill, the mask, and accepting each token. The ratio constrained / unconstrained is printed
and written with `os.getloadavg()` (the box's load) before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # engine_throughput, beside this script

from engine_throughput import best  # noqa: E402  (its warm-up run also compiles the grammar)

from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLM  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

SCHEMA = {"type": "array", "minItems": 200, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                   "name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}}}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m", help="HF model directory or the embedded model")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--batch", type=int, default=16, help="decode batch size")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt length of each request")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per figure (best is kept)")
    p.add_argument("--out", default="structured_output.json", help="where the JSON goes")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    b, n = a.batch, a.decode_tokens
    cfg = EngineConfig(model=a.model, device=a.device, dtype=a.dtype, threads=torch.get_num_threads(),
                       max_total_tokens=max(4096, b * (a.prompt_len + n + 16)), max_running_requests=b,
                       max_prefill_tokens=b * a.prompt_len, chunked_prefill_size=b * a.prompt_len)
    llm = LLM(cfg)
    rng = random.Random(1)
    vocab = llm.runner.model_cfg.vocab_size
    ps = [[rng.randrange(100, vocab - 1) for _ in range(a.prompt_len)] for _ in range(b)]
    schema = json.dumps(SCHEMA)

    def run(k: int, constrained: bool) -> None:
        sp = SamplingParams(max_new_tokens=k, temperature=0.0, ignore_eos=True,
                            json_schema=schema if constrained else None)
        out = llm.generate(ps, sp)
        assert all(len(c.output_ids) == k for c in out), [(len(c.output_ids), c.error) for c in out]

    rows = {}
    for name, constrained in (("unconstrained", False), ("json_schema", True)):
        d = best(lambda c=constrained: run(n, c), a.repeats) - best(lambda c=constrained: run(1, c), a.repeats)
        rows[name] = {"tok_s": b * (n - 1) / d, "step_ms": 1000 * d / (n - 1)}
        print(f"{name:>13}: decode {rows[name]['tok_s']:.0f} tok/s at batch {b} "
              f"(step {rows[name]['step_ms']:.1f} ms)", flush=True)
    ratio = rows["json_schema"]["tok_s"] / rows["unconstrained"]["tok_s"]
    print(f"json_schema / unconstrained: {ratio:.2f}x", flush=True)
    results = {"model": str(llm.runner.model_path), "device": a.device, "dtype": a.dtype,
               "threads": torch.get_num_threads(), "batch": b, "decode_tokens": n, "prompt_len": a.prompt_len,
               "schema": SCHEMA, **rows, "ratio": ratio, "host": platform.node(), "torch": torch.__version__,
               "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg())}
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out}; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
