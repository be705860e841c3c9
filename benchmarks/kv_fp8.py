"""FP8 KV cache (`--kv-cache-dtype fp8_e4m3`) on the embedded model: accuracy of the scale schemes, bytes, and
what the CPU pays to read FP8 pages.

    python benchmarks/kv_fp8.py [--threads 2] [--context 512] [--out docs/bench/kv_fp8.json]

Accuracy: teacher-forced mean log-probability per token of a fixed text (tests/engine/test_quantize_at_load.py's
76 tokens, and a 512-token story) with fp32 KV, and with FP8 KV under two scale schemes:
- per token-head (what the pool stores: engine/kv_fp8.py, scale = max|row| / 448, 4 bytes a row);
- per-tensor static scale 1.0 (vLLM's default without calibration): the same pool with every row's scale forced
  to 1.0 (kv_fp8.quantize patched for the run), so the codes are the values themselves, clamped to +-448.
Reported: the mean log-prob, its difference from fp32 KV, and the largest per-token difference.

Bytes: server_info()["kv_bytes_per_token"] for fp32, bf16 and FP8 KV.

Speed (CPU, one run, torch attention backend for both so only the KV dtype differs; and the native `cpu`
backend for fp32 as the default): decode tok/s at batch 1 and 16 with --context tokens cached per request.
The torch path gathers each request's pages and dequantizes them every step (codes x scale -> fp32), so FP8
costs the upcast of every key and value read.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import kv_fp8  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLM  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402

TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps and listening to "
        "the waves below. Ships passed in the night, their lights blinking like distant stars, and he wrote each "
        "one in a worn leather book. In the morning he walked to the village to buy bread, milk and the paper, "
        "and the baker always asked him whether the sea had been calm.")


def _static_quantize(x: torch.Tensor) -> torch.Tensor:
    """Per-tensor static scale 1.0: codes = the values (clamped), scale bytes = 1.0."""
    xf = x.float()
    codes = xf.clamp(-kv_fp8.FP8_MAX, kv_fp8.FP8_MAX).to(kv_fp8.FP8)
    one = torch.ones((*xf.shape[:-1], 1), dtype=torch.float32)
    return torch.cat([codes.view(torch.uint8), one.view(torch.uint8)], dim=-1)


def token_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    logp = torch.log_softmax(llm.prompt_logits(ids).float(), dim=-1)[:-1]
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def _cfg(threads: int, **kw: object) -> EngineConfig:
    base = dict(max_total_tokens=8192, page_size=16, chunked_prefill_size=512, threads=threads,
                attention_backend="torch")
    return EngineConfig(**{**base, **kw})  # type: ignore[arg-type]


def accuracy(threads: int, texts: dict[str, list[int]]) -> dict:
    out: dict = {}
    ref = {k: token_logprobs(LLM(_cfg(threads)), ids) for k, ids in texts.items()}
    fp8 = LLM(_cfg(threads, kv_cache_dtype="fp8_e4m3"))
    schemes = {"per_token_head": kv_fp8.quantize, "static_1.0": _static_quantize}
    real = kv_fp8.quantize
    for name, fn in schemes.items():
        kv_fp8.quantize = fn  # the pool calls kv_fp8.quantize at each write
        try:
            for k, ids in texts.items():
                got = token_logprobs(fp8, ids)
                out.setdefault(k, {"fp32_kv": round(ref[k].mean().item(), 4), "tokens": len(ids)})[name] = {
                    "mean_logprob": round(got.mean().item(), 4),
                    "diff_nats_per_token": round(abs(got.mean() - ref[k].mean()).item(), 4),
                    "max_token_diff": round((got - ref[k]).abs().max().item(), 4),
                }
        finally:
            kv_fp8.quantize = real
    return out


def decode_speed(threads: int, context: int, batch: int, **kw: object) -> float:
    llm = LLM(_cfg(threads, max_total_tokens=(context + 64) * batch + 64, **kw))
    prompts = [[(7 * i + j) % 5000 + 10 for j in range(context)] for i in range(batch)]
    steps = 16
    sp = SamplingParams(temperature=0.0, max_new_tokens=steps + 1, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))  # warm
    t0 = time.perf_counter()
    llm.generate(prompts, sp)
    total = time.perf_counter() - t0
    p0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=1, ignore_eos=True))
    prefill = time.perf_counter() - p0
    return round(batch * steps / max(total - prefill, 1e-9), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--context", type=int, default=512, help="cached tokens per request in the decode timing")
    ap.add_argument("--skip-speed", action="store_true", help="accuracy and bytes only")
    ap.add_argument("--out", default="", help="write the JSON here too")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    from engine.models.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    story = tok.encode((TEXT + " ") * 8)[:512]
    res: dict = {"machine": platform.processor() or platform.machine(), "threads": a.threads}
    res["accuracy"] = accuracy(a.threads, {"text76": tok.encode(TEXT), "story512": story})
    res["kv_bytes_per_token"] = {
        name: LLM(_cfg(a.threads, max_total_tokens=64, **kw)).runner.server_info()["kv_bytes_per_token"]
        for name, kw in (("float32", {}), ("bfloat16", {"dtype": "bfloat16"}), ("fp8_e4m3", {"kv_cache_dtype":
                                                                                           "fp8_e4m3"}))}
    if not a.skip_speed:
        res["decode_tok_s"] = {
            f"b{b}": {"fp32_cpu_backend": decode_speed(a.threads, a.context, b, attention_backend="cpu"),
                      "fp32_torch": decode_speed(a.threads, a.context, b),
                      "fp8_torch": decode_speed(a.threads, a.context, b, kv_cache_dtype="fp8_e4m3")}
            for b in (1, 16)}
        res["context"] = a.context
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
