"""MLA (DeepSeek) KV bytes and decode speed: what the latent buys against a same-size GQA model.

    python benchmarks/mla.py [--threads N] [--context 512] [--out mla.json]

Models (random weights written by transformers, fp32, 2 layers, hidden 1024, 16 query heads):
- MLA: DeepseekV3Config, kv_lora_rank 256, qk_rope 32, qk_nope 64, v 64 (a token caches 256 + 32 per layer);
  q_lora_rank 384, 8 routed experts top-2 + 1 shared (first layer dense).
- GQA: a Llama of the same hidden size, layers and query heads, 4 KV heads of 64 (group of 4).

Bytes: KV bytes per token read from each engine's live pool (`server_info()["kv_bytes_per_token"]`, which
tests/engine/test_deepseek.py asserts equal to (kv_lora_rank + rope) x layers x dtype size), and the bytes a PD
transfer moves for a 4096-token prompt (pages x wire page bytes, the wire page being the pool page), plus the
same arithmetic for the full DeepSeek-V3 geometry (61 layers, 576 per token per layer, bf16) against a GQA of 8
KV heads of 128 (Llama-3-70B's) and against MHA.

Speed (CPU, one run): decode tok/s at batch 16 with --context tokens cached per request, the absorbed form
(queries projected into the latent space, attention over the latents) against the naive one (every cached
latent expanded by kv_b into per-head K/V each step), both batched; and one --context-token prefill in each
prefill form; and the local broadcast a TP 2 decode runs for one received 4k prompt's latent pages
(engine/distributed/tp_kv.py broadcast_latent; gloo, loopback). decode tok/s = B * steps / time of `steps` batched
decode forwards (prompts prefilled once, untimed).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import best, prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.engine import LLM  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402

COMMON = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=16,
              max_position_embeddings=8192, tie_word_embeddings=False)
MLA = dict(kv_lora_rank=256, q_lora_rank=384, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
           num_key_value_heads=16, moe_intermediate_size=512, n_routed_experts=8, num_experts_per_tok=2,
           n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1, num_nextn_predict_layers=0)
GQA = dict(num_key_value_heads=4, head_dim=64)
PROMPT_4K = 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    p.add_argument("--batch", type=int, default=16, help="decode batch size")
    p.add_argument("--context", type=int, default=512, help="prompt tokens per decode request (and the prefill)")
    p.add_argument("--decode-tokens", type=int, default=8, help="timed decode steps (batched forwards)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per figure (best is kept)")
    p.add_argument("--out", default="mla.json", help="where the JSON goes")
    return p.parse_args(argv)


def write_models(root: Path) -> tuple[Path, Path]:
    """The random MLA and GQA directories (transformers' init, seed 0), with the embedded model's tokenizer."""
    import shutil

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

    from engine.models.embedded import resolve_model_path

    out = []
    for name, cls, cfg in (("mla", DeepseekV3ForCausalLM, DeepseekV3Config(**COMMON, **MLA)),
                           ("gqa", LlamaForCausalLM, LlamaConfig(**COMMON, **GQA))):
        torch.manual_seed(0)
        cls(cfg).save_pretrained(root / name)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(resolve_model_path("embedded") / f, root / name / f)
        out.append(root / name)
    return out[0], out[1]


def bytes_table(llms: dict[str, LLM]) -> list[dict]:
    """KV bytes per token and per 4096-token PD transfer: the two live engines, then DeepSeek-V3's geometry."""
    rows = []
    for name, llm in llms.items():
        per_token = llm.runner.server_info()["kv_bytes_per_token"]
        pages = -(-PROMPT_4K // llm.runner.page_size)
        rows.append(dict(model=f"bench {name} (fp32, 2 layers)", kv_bytes_per_token=per_token,
                         transfer_bytes_4k=pages * llm.runner.pool.page_bytes))
    layers, bf16 = 61, 2
    for name, elems in (("DeepSeek-V3 MLA (512 + 64)", 512 + 64), ("same-size GQA (8 KV heads x 128)", 2 * 8 * 128),
                        ("same-size MHA (128 heads x (192 + 128))", 128 * (192 + 128))):
        rows.append(dict(model=f"{name}, bf16, 61 layers", kv_bytes_per_token=elems * layers * bf16,
                         transfer_bytes_4k=elems * layers * bf16 * PROMPT_4K))
    return rows


def set_absorb(llm: LLM, on: bool) -> None:
    from engine.models.deepseek_mla import MLAAttention

    for m in llm.runner.model.modules():
        if isinstance(m, MLAAttention):
            m.absorb = on


def decode_tok_s(llm: LLM, a: argparse.Namespace) -> float:
    """Decode forwards of batch a.batch over a.context cached tokens each (the prompts prefilled once, not
    timed): a.batch * steps / time, the model forward alone (no sampling), best of a.repeats."""
    from engine.forward.forward_batch import LOGITS_LAST, Segment, forward_segments
    from engine.kvcache.memory import pages_for

    runner = llm.runner
    steps = a.decode_tokens
    ps = prompts(a.batch, a.context, COMMON["vocab_size"], seed=1)
    pages = [runner.pool.allocator.allocate(pages_for(a.context + steps, runner.page_size)) for _ in ps]
    try:
        for pg, ids in zip(pages, ps):
            forward_segments(runner, [Segment(pg, 0, ids, LOGITS_LAST)])

        def run() -> None:
            for i in range(steps):
                forward_segments(runner, [Segment(pg, a.context + i, [7], LOGITS_LAST) for pg in pages])

        return a.batch * steps / best(run, a.repeats)
    finally:
        for pg in pages:
            runner.pool.allocator.free(pg)


def prefill_s(llm: LLM, form: str, a: argparse.Namespace) -> float:
    import engine.models.deepseek_mla as mla

    old, mla.PREFILL_FORM = mla.PREFILL_FORM, form
    try:
        ids = prompts(1, a.context, COMMON["vocab_size"], seed=2)
        return best(lambda: llm.generate(ids, SamplingParams(temperature=0.0, max_new_tokens=1)), a.repeats)
    finally:
        mla.PREFILL_FORM = old


def _broadcast_rank(rank: int, port: int, nbytes: int, repeats: int, out) -> None:  # noqa: ANN001
    """One of 2 gloo ranks: broadcast nbytes of latent pages from rank 0, as tp_kv.broadcast_latent does."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = torch.zeros(nbytes // 4, dtype=torch.float32)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(data, src=0)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(min(times[1:]))
    dist.destroy_process_group()


def broadcast_s(nbytes: int, repeats: int) -> float:
    """Seconds for a TP 2 decode's rank 0 to hand one received prompt's latent pages (nbytes) to rank 1
    (gloo on loopback, 2 processes): what one copy per decode node costs on top of the wire."""
    import multiprocessing as mp

    from common.procs import free_port

    ctx = mp.get_context("spawn")
    port, out = free_port(), ctx.Queue()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, nbytes, repeats, out)) for r in range(2)]
    for pr in procs:
        pr.start()
    result = out.get(timeout=300)
    for pr in procs:
        pr.join(60)
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        mla_dir, gqa_dir = write_models(Path(tmp))
        tokens = a.batch * (a.context + a.decode_tokens + 16) + 64
        llms = {name: LLM(EngineConfig(model=str(d), threads=torch.get_num_threads(), max_total_tokens=tokens,
                                       max_running_requests=a.batch, chunked_prefill_size=a.context,
                                       max_prefill_tokens=a.context * 4))
                for name, d in (("mla", mla_dir), ("gqa", gqa_dir))}
        rows = bytes_table(llms)
        mla = llms["mla"]
        speed = {"decode_tok_s_absorbed": decode_tok_s(mla, a)}
        set_absorb(mla, False)
        speed["decode_tok_s_naive"] = decode_tok_s(mla, a)
        set_absorb(mla, True)
        speed["decode_tok_s_gqa"] = decode_tok_s(llms["gqa"], a)
        speed |= {f"prefill_s_{form}": prefill_s(mla, form, a) for form in ("expanded", "absorbed")}
    speed["tp2_broadcast_s_4k"] = broadcast_s(rows[0]["transfer_bytes_4k"], max(a.repeats, 2))
    print(f"{'model':58} {'KV B/token':>11} {'4k transfer':>14}")
    for r in rows:
        print(f"{r['model']:58} {r['kv_bytes_per_token']:>11,} {r['transfer_bytes_4k']:>14,}")
    print(f"ratio GQA/MLA bytes: bench {rows[1]['kv_bytes_per_token'] / rows[0]['kv_bytes_per_token']:.2f}x, "
          f"V3 geometry {rows[3]['kv_bytes_per_token'] / rows[2]['kv_bytes_per_token']:.2f}x "
          f"(MHA/MLA {rows[4]['kv_bytes_per_token'] / rows[2]['kv_bytes_per_token']:.1f}x)")
    print(f"decode batch {a.batch}, {a.context} cached tokens each: absorbed {speed['decode_tok_s_absorbed']:.1f} "
          f"tok/s, naive {speed['decode_tok_s_naive']:.1f} tok/s "
          f"({speed['decode_tok_s_absorbed'] / speed['decode_tok_s_naive']:.2f}x); "
          f"dense GQA Llama (no MoE) {speed['decode_tok_s_gqa']:.1f}")
    print(f"prefill {a.context} tokens: expanded {speed['prefill_s_expanded']:.3f} s, "
          f"absorbed {speed['prefill_s_absorbed']:.3f} s")
    print(f"TP 2 decode, one 4k prompt's latent pages ({rows[0]['transfer_bytes_4k']:,} B) rank 0 -> rank 1 "
          f"(gloo broadcast): {speed['tp2_broadcast_s_4k'] * 1e3:.1f} ms")
    out = dict(args=vars(a), bytes=rows, speed=speed, threads=torch.get_num_threads(), host=platform.node(),
               torch=torch.__version__, when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    Path(a.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
