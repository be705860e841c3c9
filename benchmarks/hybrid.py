"""Hybrid recurrent models (issue 48) against transformers on the same weights, and what a PD prefill ships.

    python benchmarks/hybrid.py [--size small|medium] [--families qwen3_next,...] [--threads 2] [--out hybrid.json]

One random-weight model per family (qwen3_next, qwen3_5_text, nemotron_h, granitemoehybrid), built from
transformers' own config class with the family's real layer mix and head geometry scaled down (FAMILIES below:
`medium` is hidden 1024 and 10-13 layers, `small` hidden 256 and 4-7 layers for quick smoke runs), transformers'
init (seed 0), saved with save_pretrained; fp32 on the CPU, --threads torch threads for both engines.

1. Prefill tok/s of one prompt of each --prefill-lens length: pdserve's ModelRunner + forward_segments, one
   request with a state slot, the prompt in --chunk-token forwards (logits for the last row only), against
   transformers' own torch forward `model(input_ids, use_cache=False, logits_to_keep=1)` under
   torch.inference_mode (logits_to_keep=1 is what `generate()` asks of a prefill, and what pdserve computes).
2. Decode tok/s at each --batches batch size: B equal-length prompts of --decode-prompt-len tokens prefilled
   (not timed), then --decode-tokens one-token steps, greedy (argmax fed back). pdserve: one forward of B
   segments per step, each with its own pages and state slot; transformers: the model's own cache object from
   the prefill, stepped with `model(next_ids, cache=..., use_cache=True)` (no padding: equal lengths).
   tok/s = B * steps / time of the steps.
3. PD bytes of a --pd-tokens prompt, no timing: what a prefill ships, from the built ModelRunner = the attention
   layers' KV pages (pages x pool.page_bytes) + the prompt's final state (states.slot_bytes, on the wire
   ceil(slot_bytes / page_bytes) extra pages: service/pd.py StateWire), against a dense model of the same
   hidden size and layer count with every layer attention (same KV heads and head dim): layers x 2 x KV heads
   x head dim x dtype bytes per token, in whole pages. Also the same arithmetic for bf16 serving (KV and
   conv states halve, the SSM / delta-rule states stay fp32). Nemotron-H's MLP-only layers count as layers of
   the dense model too (its blocks are one mixer or one MLP each, not attention + MLP), which flatters its ratio
   against a dense transformer of as many parameters.
4. Multi-turn TTFT with the prefix cache (state snapshots, docs/architecture.md "Hybrid recurrent models") on vs
   off: one conversation of --turns turns through the engine's own scheduler (engine.engine.LLM, one request at
   a time), each turn's prompt the previous prompt + its reply + --turn-len new tokens, --turn-output greedy
   tokens a reply; TTFT = add to first token. The figure is the mean TTFT of turns --ttft-from-turn.. (4-6 by
   default: later turns carry the whole history), cache off / on; the cache-on run also reports each turn's
   cached_tokens (its restart point: the deepest snapshot, every --snapshot-interval tokens and at each prompt's
   last page) and both runs' replies must be equal. The two engines alternate per round (the cache flushed
   between rounds, --repeats rounds, the best mean of each kept).

Ratios are pdserve / transformers (speed) and hybrid / dense (bytes), each from the same run; within a
figure the engines alternate (warm-up each, then --repeats rounds of pdserve then transformers; each keeps
its best), so a noisy minute does not land on one engine only. Aims (issue 48), printed beside the ratios:
prefill and decode at batch 16 at least 2x transformers; 4k-prompt PD bytes at most 0.4x the dense model's.
transformers runs its CPU reference paths (no causal_conv1d / mamba_ssm / fla kernels on the CPU); its
attention is its default (sdpa). The load average at start and end is printed and written: on a shared
machine the speed figures move with it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine_throughput import prompts  # noqa: E402
from engine.config import EngineConfig  # noqa: E402  (engine before torch: engine/__init__.py)
from engine.engine import LLM  # noqa: E402
from engine.forward.forward_batch import LOGITS_LAST, LOGITS_NONE, Segment, forward_segments  # noqa: E402
from engine.forward.model_runner import ModelRunner  # noqa: E402
from engine.kvcache.memory import pages_for  # noqa: E402
from engine.request import Req  # noqa: E402
from engine.sampling.params import SamplingParams  # noqa: E402

# isort: split
import torch  # noqa: E402

VOCAB = 8192
L, F = "linear_attention", "full_attention"  # Gated DeltaNet / attention (Qwen); Nemotron-H: Mamba2 / attention
AIMS = {"prefill": 2.0, "decode_b16": 2.0, "pd_bytes": 0.4}  # issue 48: >= 2x transformers, <= 0.4x dense bytes


def _nemotron(pattern: str) -> list[str]:
    """Nemotron-H's hybrid_override_pattern (M mamba, * attention, - MLP, E MoE) as layers_block_type."""
    return [{"M": L, "*": F, "-": "mlp", "E": "moe"}[c] for c in pattern]


# family -> (transformers config class, {size: fields}). Real geometry, scaled: Qwen3-Next-80B (hidden 2048, 48
# layers, full attention every 4th, 16 q / 2 KV heads of 256 with a quarter rotary, Gated DeltaNet 16 key / 32
# value heads of 128, 512 experts top-10 + a shared expert); Qwen3.5 (the same mixer, a dense MLP); Nemotron-H-8B
# (hidden 4096, 52 layers "M-M-M-M*-..." = Mamba2 and MLP pairs, 4 attention layers, 32 q / 8 KV heads of 128,
# Mamba 128 heads of 64, state 128, 8 groups, relu2 MLP); Granite-4.0-H (Mamba2 with 1 attention layer in 10,
# heads of 64 at 2x hidden, state 128, 1 group, MoE + a shared MLP, no positional embedding). Heads are scaled
# with the hidden size so the mixers keep their width ratios (value / Mamba width 2x hidden).
FAMILIES: dict[str, tuple[str, dict[str, dict]]] = {
    "qwen3_next": ("Qwen3NextConfig", {
        "medium": dict(hidden_size=1024, num_hidden_layers=12, layer_types=[L, L, L, F] * 3, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, linear_num_key_heads=8, linear_num_value_heads=16,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       intermediate_size=2048, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                       shared_expert_intermediate_size=256, norm_topk_prob=True),
        "small": dict(hidden_size=256, num_hidden_layers=4, layer_types=[L, L, L, F], num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=64, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                      intermediate_size=512, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128,
                      shared_expert_intermediate_size=128, norm_topk_prob=True),
    }),
    "qwen3_5_text": ("Qwen3_5TextConfig", {
        "medium": dict(hidden_size=1024, num_hidden_layers=12, layer_types=[L, L, L, F] * 3, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=256, linear_num_key_heads=8, linear_num_value_heads=16,
                       linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                       intermediate_size=3072),
        "small": dict(hidden_size=256, num_hidden_layers=4, layer_types=[L, L, L, F], num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=64, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                      intermediate_size=768),
    }),
    "nemotron_h": ("NemotronHConfig", {
        "medium": dict(hidden_size=1024, layers_block_type=_nemotron("M-M-M-M*-M-M-"), num_attention_heads=8,
                       num_key_value_heads=2, head_dim=128, intermediate_size=4096, mamba_num_heads=32,
                       mamba_head_dim=64, ssm_state_size=128, n_groups=2, conv_kernel=4, chunk_size=128),
        "small": dict(hidden_size=256, layers_block_type=_nemotron("M-M*-M-"), num_attention_heads=4,
                      num_key_value_heads=2, head_dim=64, intermediate_size=1024, mamba_num_heads=8,
                      mamba_head_dim=64, ssm_state_size=64, n_groups=2, conv_kernel=4, chunk_size=128),
    }),
    "granitemoehybrid": ("GraniteMoeHybridConfig", {
        "medium": dict(hidden_size=1024, num_hidden_layers=10,
                       layer_types=["mamba"] * 5 + ["attention"] + ["mamba"] * 4, num_attention_heads=8,
                       num_key_value_heads=2, mamba_n_heads=32, mamba_d_head=64,
                       mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=256,
                       num_local_experts=16, num_experts_per_tok=4, intermediate_size=256,
                       shared_intermediate_size=1024, position_embedding_type="nope"),
        "small": dict(hidden_size=256, num_hidden_layers=5,
                      layer_types=["mamba", "mamba", "attention", "mamba", "mamba"], num_attention_heads=4,
                      num_key_value_heads=2, mamba_n_heads=8, mamba_d_head=64,
                      mamba_d_state=64, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=128,
                      num_local_experts=8, num_experts_per_tok=2, intermediate_size=128,
                      shared_intermediate_size=512, position_embedding_type="nope"),
    }),
}
COMMON = dict(vocab_size=VOCAB, max_position_embeddings=8192, tie_word_embeddings=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated, from {', '.join(FAMILIES)} (default: all)")
    p.add_argument("--size", choices=("small", "medium"), default="medium",
                   help="benchmark model size: medium (hidden 1024, 10-13 layers) or small (hidden 256, 4-7 "
                        "layers: a quick smoke run)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads for both engines")
    p.add_argument("--prefill-lens", default="512,2048", help="prefill prompt lengths in tokens, comma-separated")
    p.add_argument("--chunk", type=int, default=512, help="pdserve's prefill chunk (tokens per forward)")
    p.add_argument("--batches", default="1,16", help="decode batch sizes, comma-separated")
    p.add_argument("--decode-prompt-len", type=int, default=128, help="prompt length of each decode request")
    p.add_argument("--decode-tokens", type=int, default=16, help="timed one-token decode steps")
    p.add_argument("--pd-tokens", type=int, default=4096, help="prompt length of the PD bytes figure")
    p.add_argument("--turns", type=int, default=6, help="multi-turn TTFT: turns of the conversation")
    p.add_argument("--turn-len", type=int, default=200, help="multi-turn TTFT: new tokens each turn's prompt adds")
    p.add_argument("--turn-output", type=int, default=16, help="multi-turn TTFT: tokens of each reply")
    p.add_argument("--ttft-from-turn", type=int, default=4, help="multi-turn TTFT: first turn (1-based) of the mean")
    p.add_argument("--snapshot-interval", type=int, default=256,
                   help="multi-turn TTFT: --state-snapshot-interval of the cache-on engine")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed rounds per figure, pdserve and transformers alternating (best of each is kept)")
    p.add_argument("--out", default="hybrid.json", help="where the JSON goes")
    a = p.parse_args(argv)
    a.families = [f.strip() for f in a.families.split(",") if f.strip()]
    unknown = [f for f in a.families if f not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    a.prefill_lens = [int(x) for x in a.prefill_lens.split(",") if x.strip()]
    a.batches = [int(x) for x in a.batches.split(",") if x.strip()]
    if a.threads < 1 or a.chunk < 1 or a.decode_tokens < 1 or a.repeats < 1 or not a.prefill_lens or not a.batches:
        p.error("--threads, --chunk, --decode-tokens and --repeats must be >= 1; --prefill-lens and --batches "
                "must name at least one value")
    if not 1 <= a.ttft_from_turn <= a.turns or a.turn_len < 1 or a.turn_output < 1 or a.snapshot_interval % 16:
        p.error("--ttft-from-turn must be in 1..--turns; --turn-len and --turn-output >= 1; --snapshot-interval a "
                "multiple of the page size (16)")
    return a


def write_model(name: str, size: str, dst: Path) -> torch.nn.Module:
    """transformers' causal LM of family `name` at `size` (its own init, seed 0, fp32, eval), saved at dst with
    the embedded model's tokenizer (the engine's scheduler of figure 4 loads one; the figures feed token ids)."""
    import shutil

    import transformers
    from transformers import AutoModelForCausalLM

    from engine.models.embedded import resolve_model_path

    cls, sizes = FAMILIES[name]
    cfg = getattr(transformers, cls)(**COMMON, **sizes[size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve_model_path("embedded") / f, dst / f)
    return model


def build_runner(path: Path, a: argparse.Namespace) -> ModelRunner:
    tokens = max(max(a.prefill_lens), max(a.batches) * (a.decode_prompt_len + a.decode_tokens + 32)) + 256
    return ModelRunner(EngineConfig(model=str(path), threads=a.threads, max_total_tokens=tokens,
                                    max_running_requests=max(a.batches), chunked_prefill_size=a.chunk,
                                    max_prefill_tokens=max(a.chunk, max(a.batches) * a.decode_prompt_len)))


class Requests:
    """B requests on a runner: each its pages (for `tokens` tokens) and one state slot; freed by close()."""

    def __init__(self, runner: ModelRunner, b: int, tokens: int) -> None:
        self.runner = runner
        self.pages = [runner.pool.allocator.allocate(pages_for(tokens, runner.page_size)) for _ in range(b)]
        self.slots = runner.states.allocate(b)

    def close(self) -> None:
        for pg in self.pages:
            self.runner.pool.allocator.free(pg)
        self.runner.states.free(self.slots)


# Each timed function returns (seconds of the timed part, last logits [V] of the first request).

@torch.inference_mode()
def ours_prefill(runner: ModelRunner, ids: list[int], chunk: int) -> tuple[float, torch.Tensor]:
    """One request's prompt in `chunk`-token forwards (its state slot carried across them)."""
    req = Requests(runner, 1, len(ids))
    try:
        t0 = time.perf_counter()
        for s in range(0, len(ids), chunk):
            last = s + chunk >= len(ids)
            out = forward_segments(runner, [Segment(req.pages[0], s, ids[s : s + chunk],
                                                    LOGITS_LAST if last else LOGITS_NONE, slot=req.slots[0])])
        return time.perf_counter() - t0, out.logits[0]
    finally:
        req.close()


def hf_cache_kw(hf: torch.nn.Module) -> str:
    """The name transformers' forward takes the cache by (`cache` since 5.x; `past_key_values` before)."""
    import inspect

    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


@torch.inference_mode()
def hf_prefill(hf: torch.nn.Module, ids: list[int]) -> tuple[float, torch.Tensor]:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    out = hf(input_ids=x, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - t0, out.logits[0, -1]


@torch.inference_mode()
def ours_decode(runner: ModelRunner, ps: list[list[int]], steps: int) -> tuple[float, torch.Tensor]:
    """B prompts prefilled in one forward (not timed), then `steps` forwards of B one-token segments."""
    n = len(ps[0])
    req = Requests(runner, len(ps), n + steps)
    try:
        out = forward_segments(runner, [Segment(pg, 0, p, LOGITS_LAST, slot=s)
                                        for pg, p, s in zip(req.pages, ps, req.slots)])
        toks = torch.stack(out.logits).argmax(-1).tolist()
        t0 = time.perf_counter()
        for i in range(steps):
            out = forward_segments(runner, [Segment(pg, n + i, [t], LOGITS_LAST, slot=s)
                                            for pg, t, s in zip(req.pages, toks, req.slots)])
            toks = torch.stack(out.logits).argmax(-1).tolist()
        return time.perf_counter() - t0, out.logits[0]
    finally:
        req.close()


@torch.inference_mode()
def hf_decode(hf: torch.nn.Module, ps: list[list[int]], steps: int) -> tuple[float, torch.Tensor]:
    """The B prompts prefilled with use_cache (not timed), then `steps` one-token steps on the model's own cache."""
    kw = hf_cache_kw(hf)
    out = hf(input_ids=torch.tensor(ps), use_cache=True, logits_to_keep=1)
    cache, tok = out[kw], out.logits[:, -1].argmax(-1, keepdim=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(input_ids=tok, use_cache=True, **{kw: cache})
        cache, tok = out[kw], out.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t0, out.logits[0, -1]


def alternate(ours, theirs, repeats: int) -> tuple[float, float, float]:  # noqa: ANN001
    """Warm each up, then `repeats` rounds of (ours, theirs): (best seconds ours, best theirs, max |logit diff| of
    the last logits the two returned in the last round: a same-weights check)."""
    ours(), theirs()
    t_ours, t_theirs = math.inf, math.inf
    for _ in range(repeats):
        (t1, l1), (t2, l2) = ours(), theirs()
        t_ours, t_theirs = min(t_ours, t1), min(t_theirs, t2)
    return t_ours, t_theirs, (l1.float() - l2.float()).abs().max().item()


def pd_bytes(runner: ModelRunner, tokens: int) -> dict:
    """What a PD prefill of a `tokens` prompt ships (KV pages of the attention layers + one state slot) against a
    dense model of the same layers, all attention with the same KV heads and head dim; fp32 as built, and the
    same arithmetic for bf16 (KV and conv states in the model dtype halve, the SSM states stay fp32)."""
    mc, pool, states = runner.model_cfg, runner.pool, runner.states
    ps, elem = runner.page_size, pool.buffer.element_size()
    per_layer_page = 2 * ps * mc.num_kv_heads * mc.head_dim * elem
    if pool.page_bytes != mc.num_kv_layers * per_layer_page:
        print(f"  note: pool.page_bytes {pool.page_bytes} != {mc.num_kv_layers} KV layers x {per_layer_page} "
              "(the dense figure below assumes the latter per layer)", flush=True)
    pages = -(-tokens // ps)
    kv = pages * pool.page_bytes
    state = states.slot_bytes
    state_wire = -(-state // pool.page_bytes) * pool.page_bytes
    dense = pages * mc.num_layers * per_layer_page
    # bf16 serving: the KV and the conv states (model dtype) take 2 bytes an element, the SSM states stay fp32
    kv_bf16 = kv * 2 // elem
    state_bf16 = sum(p.nbytes * 2 // torch.empty((), dtype=p.dtype).element_size() if p.name.endswith(".conv")
                     else p.nbytes for p in states.spec.parts)
    dense_bf16 = dense * 2 // elem
    return {"tokens": tokens, "page_size": ps, "pages": pages, "kv_layers": mc.num_kv_layers, "layers": mc.num_layers,
            "page_bytes": pool.page_bytes, "kv_bytes": kv, "state_bytes": state, "state_wire_bytes": state_wire,
            "hybrid_bytes": kv + state, "hybrid_wire_bytes": kv + state_wire, "dense_bytes": dense,
            "ratio": (kv + state_wire) / dense, "ratio_raw": (kv + state) / dense,
            "bf16": {"kv_bytes": kv_bf16, "state_bytes": state_bf16, "dense_bytes": dense_bf16,
                     "ratio": (kv_bf16 + state_bf16) / dense_bf16}}


def conversation_llm(path: Path, a: argparse.Namespace, cache: bool) -> LLM:
    """The engine of the multi-turn figure: its own runner, the prefix cache on or off."""
    tokens = a.turns * (a.turn_len + a.turn_output) + 256
    return LLM(EngineConfig(model=str(path), threads=a.threads, max_total_tokens=max(4096, 2 * tokens),
                            page_size=16, chunked_prefill_size=a.chunk, max_prefill_tokens=max(a.chunk, 2048),
                            prefix_cache=cache, state_snapshot_interval=a.snapshot_interval))


@torch.inference_mode()
def conversation(llm: LLM, a: argparse.Namespace, seed: int) -> list[dict]:
    """One conversation, a turn at a time: per turn its prompt length, TTFT (s), cached tokens and reply."""
    params = SamplingParams(temperature=0.0, max_new_tokens=a.turn_output, ignore_eos=True)
    sched, rows, history = llm.scheduler, [], []
    for t in range(a.turns):
        history = history + prompts(1, a.turn_len, VOCAB, seed=seed * 1000 + t)[0]
        r = Req(rid=f"t{t}", token_ids=list(history), sampling=params)
        t0 = time.perf_counter()
        sched.add(r)
        while not r.output_ids and not r.finished:
            sched.step()
            sched.drain()
        ttft = time.perf_counter() - t0
        while not r.finished:
            sched.step()
            sched.drain()
        if r.error:
            raise RuntimeError(f"turn {t + 1}: {r.error}")
        rows.append({"turn": t + 1, "prompt_tokens": len(history), "ttft_s": ttft, "cached_tokens": r.kv.cached_tokens,
                     "output_ids": list(r.output_ids)})
        history = history + r.output_ids
    return rows


def multi_turn_ttft(path: Path, a: argparse.Namespace) -> dict:
    """Figure 4: mean TTFT of turns --ttft-from-turn.. with the prefix cache off and on (alternating rounds,
    the cache flushed between them; best mean of each)."""
    engines = {"off": conversation_llm(path, a, False), "on": conversation_llm(path, a, True)}
    best: dict[str, tuple[float, list[dict]]] = {"off": (math.inf, []), "on": (math.inf, [])}
    late = slice(a.ttft_from_turn - 1, a.turns)
    equal = True  # both engines' replies, every round (the same conversation in a round)
    for rnd in range(a.repeats + 1):  # round 0: warm-up
        replies = []
        for key, llm in engines.items():
            llm.scheduler.kv.flush()
            rows = conversation(llm, a, rnd)
            replies.append([x["output_ids"] for x in rows])
            mean = sum(x["ttft_s"] for x in rows[late]) / len(rows[late])
            if rnd and mean < best[key][0]:
                best[key] = (mean, rows)
        equal = equal and replies[0] == replies[1]
    kv = engines["on"].scheduler.kv
    return {"turns": a.turns, "turn_len": a.turn_len, "turn_output": a.turn_output, "from_turn": a.ttft_from_turn,
            "snapshot_interval": a.snapshot_interval, "ttft_off_s": best["off"][0], "ttft_on_s": best["on"][0],
            "ratio": best["off"][0] / best["on"][0], "outputs_equal": equal,
            "per_turn": {k: [{f: x[f] for f in ("turn", "prompt_tokens", "ttft_s", "cached_tokens")} for x in rows]
                         for k, (_, rows) in best.items()},
            "snapshot_slots": kv.snapshot_slots, "snapshots_taken": kv.snapshots_taken,
            "state_slot_mib": kv.states.slot_bytes / 2**20}


def run_family(name: str, a: argparse.Namespace, tmp: Path) -> dict:
    t0 = time.perf_counter()
    hf = write_model(name, a.size, tmp / name)
    runner = build_runner(tmp / name, a)
    torch.set_num_threads(a.threads)  # both engines alike (ModelRunner sets it too)
    mc = runner.model_cfg
    recurrent = sum(p.name.endswith(".ssm") for p in runner.states.spec.parts)
    row: dict = {"family": name, "size": a.size, "config": FAMILIES[name][1][a.size],
                 "params": sum(p.numel() for p in hf.parameters()), "layers": mc.num_layers,
                 "attention_layers": mc.num_kv_layers, "recurrent_layers": recurrent,
                 "hf_attn_implementation": hf.config._attn_implementation, "prefill": [], "decode": []}
    print(f"{name} ({a.size}): {row['params'] / 1e6:.1f}M params, {mc.num_layers} layers ({mc.num_kv_layers} "
          f"attention, {recurrent} recurrent, {mc.num_layers - mc.num_kv_layers - recurrent} MLP-only), state slot "
          f"{runner.states.slot_bytes / 2**20:.2f} MiB; built in {time.perf_counter() - t0:.1f} s", flush=True)

    for n in a.prefill_lens:
        ids = prompts(1, n, VOCAB, seed=n)[0]
        t_ours, t_hf, diff = alternate(lambda ids=ids: ours_prefill(runner, ids, a.chunk),
                                       lambda ids=ids: hf_prefill(hf, ids), a.repeats)
        r = {"tokens": n, "chunk": a.chunk, "tok_s": n / t_ours, "hf_tok_s": n / t_hf, "ratio": t_hf / t_ours,
             "last_logits_max_abs_diff": diff}
        row["prefill"].append(r)
        print(f"  prefill {n:>5} tokens: pdserve {r['tok_s']:8.1f} tok/s, transformers {r['hf_tok_s']:8.1f} tok/s, "
              f"ratio {r['ratio']:.2f}x (last logits max |diff| {diff:.1e})", flush=True)

    for b in a.batches:
        ps = prompts(b, a.decode_prompt_len, VOCAB, seed=100 + b)
        steps = a.decode_tokens
        t_ours, t_hf, diff = alternate(lambda ps=ps: ours_decode(runner, ps, a.decode_tokens),
                                       lambda ps=ps: hf_decode(hf, ps, a.decode_tokens), a.repeats)
        r = {"batch": b, "prompt_len": a.decode_prompt_len, "steps": steps, "tok_s": b * steps / t_ours,
             "hf_tok_s": b * steps / t_hf, "ratio": t_hf / t_ours, "step_ms": 1e3 * t_ours / steps,
             "hf_step_ms": 1e3 * t_hf / steps, "last_logits_max_abs_diff": diff}
        row["decode"].append(r)
        print(f"  decode batch {b:>3}: pdserve {r['tok_s']:8.1f} tok/s ({r['step_ms']:.1f} ms/step), transformers "
              f"{r['hf_tok_s']:8.1f} tok/s ({r['hf_step_ms']:.1f} ms/step), ratio {r['ratio']:.2f}x "
              f"(last logits max |diff| {diff:.1e})", flush=True)

    row["pd_bytes"] = pd = pd_bytes(runner, a.pd_tokens)
    print(f"  PD bytes, {a.pd_tokens}-token prompt: KV {pd['kv_bytes'] / 2**20:.2f} MiB ({pd['kv_layers']} of "
          f"{pd['layers']} layers) + state {pd['state_bytes'] / 2**20:.2f} MiB "
          f"(wire {pd['state_wire_bytes'] / 2**20:.2f} MiB) = {pd['hybrid_wire_bytes'] / 2**20:.2f} MiB vs dense "
          f"{pd['dense_bytes'] / 2**20:.2f} MiB: "
          f"{pd['ratio']:.3f}x (bf16 serving: {pd['bf16']['ratio']:.3f}x)", flush=True)
    row["multi_turn_ttft"] = mt = multi_turn_ttft(tmp / name, a)
    cached = ", ".join(str(x["cached_tokens"]) for x in mt["per_turn"]["on"])
    print(f"  multi-turn TTFT, turns {a.ttft_from_turn}-{a.turns} ({a.turn_len} new + {a.turn_output} reply tokens "
          f"a turn): cache off {1e3 * mt['ttft_off_s']:.1f} ms, on {1e3 * mt['ttft_on_s']:.1f} ms, ratio "
          f"{mt['ratio']:.2f}x; cached tokens per turn {cached}; {mt['snapshots_taken']} snapshots taken "
          f"({mt['state_slot_mib']:.2f} MiB each, {mt['snapshot_slots']} slots)"
          + f"; replies equal: {mt['outputs_equal']}", flush=True)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    return row


def table(rows: list[dict]) -> None:
    """Every figure with its baseline, the ratio and the aim beside it."""
    def aim(v: float, target: float, le: bool = False) -> str:
        ok = v <= target if le else v >= target
        return f"{'<=' if le else '>='} {target:g}x: {'met' if ok else 'NOT met'}"

    print(f"\n{'family':17} {'figure':15} {'pdserve':>14} {'baseline':>27} {'ratio':>7}  aim (issue 48)")
    for r in rows:
        fam = r["family"]
        for p in r["prefill"]:
            print(f"{fam:17} {'prefill ' + str(p['tokens']):15} {p['tok_s']:>8.1f} tok/s {p['hf_tok_s']:>8.1f} tok/s "
                  f"transformers {p['ratio']:>6.2f}x  {aim(p['ratio'], AIMS['prefill'])}")
            fam = ""
        for d in r["decode"]:
            target = aim(d["ratio"], AIMS["decode_b16"]) if d["batch"] == 16 else "-"
            print(f"{fam:17} {'decode b' + str(d['batch']):15} {d['tok_s']:>8.1f} tok/s {d['hf_tok_s']:>8.1f} tok/s "
                  f"transformers {d['ratio']:>6.2f}x  {target}")
            fam = ""
        pd = r["pd_bytes"]
        print(f"{'':17} {'PD bytes ' + str(pd['tokens']):15} {pd['hybrid_wire_bytes'] / 2**20:>10.2f} MiB "
              f"{pd['dense_bytes'] / 2**20:>10.2f} MiB dense model {pd['ratio']:>7.3f}x  "
              f"{aim(pd['ratio'], AIMS['pd_bytes'], le=True) if pd['tokens'] == 4096 else '-'} "
              f"(bf16 serving: {pd['bf16']['ratio']:.3f}x)")
        mt = r["multi_turn_ttft"]
        print(f"{'':17} {'TTFT turns ' + str(mt['from_turn']) + '-' + str(mt['turns']):15} "
              f"{1e3 * mt['ttft_on_s']:>11.1f} ms {1e3 * mt['ttft_off_s']:>11.1f} ms cache off "
              f"{mt['ratio']:>9.2f}x  -")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    load = os.getloadavg()
    print(f"load average at start {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, {os.cpu_count()} CPUs, {a.threads} "
          f"threads, size {a.size}, families {', '.join(a.families)}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.families:
            rows.append(run_family(name, a, Path(tmp)))
    table(rows)
    import transformers

    result = {"args": vars(a), "aims": AIMS, "families": rows, "threads": a.threads, "host": platform.node(),
              "torch": torch.__version__,
              "transformers": transformers.__version__, "load_average_start": load,
              "load_average_end": os.getloadavg(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(a.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
