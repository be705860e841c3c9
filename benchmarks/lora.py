"""LoRA cost: decode tok/s at batch B with adapters mixed vs the base model alone, in the same run, and
adapter load time.

    python benchmarks/lora.py [--model embedded:smollm2-135m] [--threads 2] [--batch 16] [--adapters 4]
                              [--rank 16] [--out lora.json]

Random PEFT-format adapters (rank --rank on q/k/v/o and gate/up/down, written here) are loaded at
start-up. Decode at batch B: B distinct prompts of --prompt-len tokens generating --decode-tokens
each (ignore_eos); decode time = time(generate N) - time(generate 1), so prefill is not counted;
tok/s = B * (N - 1) / decode time. "base" runs every request on the base model (no adapter: the
forward takes the unchanged no-LoRA path), "mixed" gives request i adapter i mod A. The two
alternate --rounds times and each keeps its best. Load time: each adapter loaded into a fresh
slot --repeats times (the registry's timer: read + slice + copy), median.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig, ModelConfig  # noqa: E402
from engine.engine import LLM  # noqa: E402
from engine.extras.lora.adapter import write_random_adapter  # noqa: E402
from engine.models.embedded import resolve_model_path  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402


def decode_tps(llm: LLM, prompts: list[list[int]], loras: list[str], n: int) -> float:
    """B * (n - 1) / (time(generate n) - time(generate 1))."""
    def run(k: int) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=k, ignore_eos=True), loras=loras)
        return time.perf_counter() - t0
    return len(prompts) * (n - 1) / max(run(n) - run(1), 1e-9)


def load_seconds(llm: LLM, paths: list[Path], repeats: int) -> float:
    """Median time to load one adapter into a free slot (unloaded again after each)."""
    reg = llm.runner.lora
    times = []
    for i in range(repeats):
        for p in paths:
            name = f"timed-{i}-{p.name}"
            reg.load(name, str(p))
            times.append(reg.load_seconds[name])
            reg.unload(name)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="embedded:smollm2-135m")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="timed loads per adapter")
    p.add_argument("--out", default="lora.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    mc = ModelConfig.from_dir(resolve_model_path(a.model))
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-lora-bench-"))
    paths = [write_random_adapter(tmp / f"a{i}", mc, a.rank, seed=i) for i in range(a.adapters)]
    cfg = EngineConfig(model=a.model, threads=a.threads, max_total_tokens=16384, max_lora_rank=a.rank,
                       max_loaded_loras=a.adapters + 1, max_loras_per_batch=a.adapters,
                       lora_paths=tuple(f"{q.name}={q}" for q in paths))
    llm = LLM(cfg)
    rnd = random.Random(0)
    prompts = [[rnd.randrange(100, mc.vocab_size - 100) for _ in range(a.prompt_len)] for _ in range(a.batch)]
    kinds = {"base": [""] * a.batch, "mixed": [paths[i % a.adapters].name for i in range(a.batch)]}
    decode_tps(llm, prompts, kinds["mixed"], 4)  # warm-up
    best = {k: 0.0 for k in kinds}
    for _ in range(a.rounds):
        for k, loras in kinds.items():
            best[k] = max(best[k], decode_tps(llm, prompts, loras, a.decode_tokens))
    load_s = load_seconds(llm, paths, a.repeats)
    ratio = best["mixed"] / best["base"]
    print(f"model {a.model}, batch {a.batch}, {a.adapters} adapters of rank {a.rank} (all 7 linears), "
          f"{a.threads} threads, best of {a.rounds}")
    print(f"| run | decode tok/s |\n|---|---|\n| base only | {best['base']:.1f} |\n"
          f"| {a.adapters} adapters mixed | {best['mixed']:.1f} |\n| ratio mixed/base | {ratio:.2f} |")
    print(f"adapter load time (median): {load_s * 1000:.1f} ms")
    Path(a.out).write_text(json.dumps({"model": a.model, "batch": a.batch, "adapters": a.adapters, "rank": a.rank,
                                       "threads": a.threads, "decode_tok_s": best, "ratio": ratio,
                                       "load_s": load_s, "machine": platform.processor() or platform.machine()},
                                      indent=2))


if __name__ == "__main__":
    main()
