"""Whole models on the GPU's code path: every family kind runs prefill (two chunks) and a few batched decode
steps with `--attention-backend triton`, and matches the torch reference on the CPU (`--attention-backend
torch`): greedy tokens equal, logits within LOGIT_BOUND at every step.

On a CPU box (CI) the subject runs under Triton's interpreter (TRITON_INTERPRET=1, CPU tensors); on a GPU
(benchmarks/gpu_check.sh) the same tests run the compiled kernels on CUDA against the CPU reference. The
triton attention backend is what turns on the models' own Triton kernels (engine.attention.base.triton_kernels),
and each case asserts they ran on the subject and never on the reference:

  dense GQA (llama)          paged extend + decode attention kernels
  sliding window (mistral)   the same with a window of 8 < the sequence
  MoE (qwen3_moe)            the fused-MoE grouped GEMMs (engine/models/moe_triton.py)
  MLA (deepseek_v3)          the absorbed MLA decode kernel (engine/attention/mla_triton.py) + fused MoE
  LoRA (llama + 2 adapters)  the slot stacks and SGMV (engine/extras/lora/triton_sgmv.py), base and two
                             adapters in one batch
  hybrid GDN (qwen3_next)    conv1d + gated-delta decode steps (engine/recurrent/triton_steps.py) + fused MoE
  hybrid Mamba2 (nemotron_h) conv1d + SSD decode steps

Tiny shapes (hidden 64, 2-3 layers, pages of 4 tokens, prompts of 21 and 10 tokens, 3 decode steps): the
interpreter runs a numpy program per Triton program, so a case costs seconds, not minutes.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # the optional `gpu` extra (not imported here: see below)
    pytest.skip("triton is not installed (the gpu extra)", allow_module_level=True)

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
# Triton decides interpreter or compiler when a function is decorated, its own library's @jit functions
# (tl.zeros, tl.sum, ...) included when triton is first imported: import (or re-import) the kernel modules with
# the variable set, in dependency order (mla_triton takes names from triton_kernels), then restore it so other
# tests never see it. The fixture below sets it again while these tests launch kernels.
KERNEL_MODULES = ("engine.attention.triton_kernels", "engine.attention.mla_triton", "engine.models.moe_triton",
                  "engine.extras.lora.triton_sgmv", "engine.recurrent.triton_steps")
if not ON_CUDA:
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for _name in KERNEL_MODULES:
            importlib.reload(importlib.import_module(_name))
    finally:
        if _prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _prev

from engine.config import EngineConfig  # noqa: E402
from engine.extras.lora.batch import Adapter  # noqa: E402
from engine.forward.forward_batch import LOGITS_LAST, Segment, forward_segments  # noqa: E402
from engine.forward.model_runner import ModelRunner  # noqa: E402
from engine.kvcache.memory import pages_for  # noqa: E402

SUBJECT_DEVICE = "cuda" if ON_CUDA else "cpu"
LOGIT_BOUND = 1e-3  # fp32 on both sides; measured: 1e-6 .. 1e-5 under the interpreter
VOCAB = 256
PROMPTS = ([(7 * i + 3) % 250 + 1 for i in range(21)], [(11 * i + 5) % 250 + 1 for i in range(10)])
CHUNK = 12  # the 21-token prompt takes two chunks: the second one extends over cached pages
STEPS = 3
PAGE = 4
# the entry points of the models' own Triton kernels: (module, function)
KERNELS = {"fused_moe": ("engine.models.moe_triton", "fused_moe"),
           "mla_decode": ("engine.attention.mla_triton", "mla_decode_triton"),
           "sgmv": ("engine.extras.lora.triton_sgmv", "sgmv"),
           "conv1d_step": ("engine.recurrent.triton_steps", "conv1d_decode_step"),
           "gdn_step": ("engine.recurrent.triton_steps", "gdn_decode_step"),
           "ssd_step": ("engine.recurrent.triton_steps", "ssd_decode_step")}


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# ---- tiny random-weight checkpoints -------------------------------------------------------------------------


def _hf_save(config, dst: Path, std: float) -> None:  # noqa: ANN001
    """transformers' model for `config` with matrices N(0, std) from a fixed seed, saved fp32 to `dst`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "conv1d" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(dst)


def _llama(dst: Path) -> Path:
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(dst)


def _mistral(dst: Path) -> Path:
    from tests.tiny_model import make_tiny_model

    return make_tiny_model(dst, model_type="mistral", sliding_window=8)


def _qwen3_moe(dst: Path) -> Path:
    import transformers

    _hf_save(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[0], max_position_embeddings=256), dst, 0.1)
    return dst


def _deepseek_v3(dst: Path) -> Path:
    import transformers

    _hf_save(transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16,
        v_head_dim=24, qk_nope_head_dim=32, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, n_group=4, topk_group=2, num_nextn_predict_layers=0,
        max_position_embeddings=256), dst, 0.2)
    return dst


def _hybrid(kind: str) -> Callable[[Path], Path]:
    def write(dst: Path) -> Path:
        from tests.hybrid_models import write_hybrid

        write_hybrid(kind, dst)
        return dst
    return write


ATTN = ("attention_extend", "attention_decode")  # the triton attention backend's two kernels
# kind -> (checkpoint writer, kernels that must run on the subject, adapters per prompt); MLA layers attend
# through their own forms (expanded SDPA for extends, the MLA decode kernel), not the attention backend
CASES: dict[str, tuple[Callable[[Path], Path], tuple[str, ...], tuple[str, ...]]] = {
    "dense_gqa": (_llama, ATTN, ("", "")),
    "sliding_window": (_mistral, (*ATTN, "attention_window"), ("", "")),
    "moe": (_qwen3_moe, (*ATTN, "fused_moe"), ("", "")),
    "mla": (_deepseek_v3, ("mla_decode", "fused_moe"), ("", "")),
    "lora": (_llama, (*ATTN, "sgmv"), ("a", "b")),
    "hybrid_gdn": (_hybrid("qwen3_next"), (*ATTN, "conv1d_step", "gdn_step", "fused_moe"), ("", "")),
    "hybrid_mamba2": (_hybrid("nemotron_h"), (*ATTN, "conv1d_step", "ssd_step"), ("", "")),
}


# ---- the driver -----------------------------------------------------------------------------------------------


def _runner(path: Path, backend: str, device: str, lora: dict[str, Path] | None) -> ModelRunner:
    extra = {} if not lora else dict(max_loaded_loras=2, max_lora_rank=8,
                                     lora_paths=tuple(f"{n}={p}" for n, p in lora.items()))
    return ModelRunner(EngineConfig(model=str(path), device=device, attention_backend=backend, page_size=PAGE,
                                    max_total_tokens=256, max_running_requests=4, threads=1, **extra))


def greedy(runner: ModelRunner, adapters: tuple[str, ...]) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Both prompts in one batch: prefill in CHUNK-token chunks, then STEPS batched decode steps, greedy.
    Returns each request's tokens and the logits of every step (fp32 [B, V] on the CPU)."""
    n = len(PROMPTS)
    pages = [runner.pool.allocator.allocate(pages_for(len(p) + STEPS, PAGE)) for p in PROMPTS]
    slots = runner.states.allocate(n) if runner.states is not None else [-1] * n
    extras = [(Adapter(a),) if a else () for a in adapters]
    tokens: list[list[int]] = [[] for _ in range(n)]
    steps: list[torch.Tensor] = []
    try:
        last: list[torch.Tensor | None] = [None] * n
        for start in range(0, max(len(p) for p in PROMPTS), CHUNK):
            live = [i for i, p in enumerate(PROMPTS) if start < len(p)]
            out = forward_segments(runner, [Segment(pages[i], start, PROMPTS[i][start : start + CHUNK], LOGITS_LAST,
                                                    0, extras[i], slots[i]) for i in live])
            for j, i in enumerate(live):
                last[i] = out.logits[j]
        for k in range(STEPS + 1):
            step = torch.stack([x.float().cpu() for x in last])  # [B, V]
            steps.append(step)
            for i in range(n):
                tokens[i].append(int(step[i].argmax()))
            if k == STEPS:
                break
            out = forward_segments(runner, [Segment(pages[i], len(PROMPTS[i]) + k, [tokens[i][-1]], LOGITS_LAST,
                                                    0, extras[i], slots[i]) for i in range(n)])
            last = list(out.logits)
    finally:
        for p in pages:
            runner.pool.allocator.free(p)
        if runner.states is not None:
            runner.states.free(slots)
    return tokens, steps


def _spy(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Count calls of the models' Triton kernel entry points (looked up by module at each call)."""
    calls: Counter = Counter()
    for key, (module, name) in KERNELS.items():
        mod = importlib.import_module(module)
        fn = getattr(mod, name)

        def counted(*a, _fn=fn, _key=key, **kw):  # noqa: ANN002, ANN003, ANN202
            calls[_key] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(mod, name, counted)
    return calls


def _attention_spy(runner: ModelRunner, calls: Counter) -> None:
    fwd = runner.backend.forward

    def counted(q, k, v, meta, window=0):  # noqa: ANN001, ANN202
        calls["attention_decode" if meta.max_q_len == 1 else "attention_extend"] += 1
        if window:
            calls["attention_window"] += 1
        return fwd(q, k, v, meta, window)
    runner.backend.forward = counted


@pytest.mark.parametrize("kind", list(CASES))
def test_triton_path_matches_torch_reference(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write, kernels, adapters = CASES[kind]
    path = write(tmp_path / "model")
    lora = None
    if kind == "lora":
        from engine.config import ModelConfig
        from engine.extras.lora.adapter import write_random_adapter

        mc = ModelConfig.from_dir(path)
        lora = {"a": write_random_adapter(tmp_path / "a", mc, 4, ("q_proj", "v_proj", "down_proj"), seed=1, std=0.3),
                "b": write_random_adapter(tmp_path / "b", mc, 8, seed=2, std=0.3)}
    calls = _spy(monkeypatch)

    ref = _runner(path, "torch", "cpu", lora)
    assert not ref.triton
    want_tokens, want = greedy(ref, adapters)
    assert not calls, f"the torch reference ran Triton kernels: {dict(calls)}"

    sub = _runner(path, "triton", SUBJECT_DEVICE, lora)
    assert sub.triton and sub.backend.name == "triton"
    _attention_spy(sub, calls)
    got_tokens, got = greedy(sub, adapters)

    for name in kernels:
        assert calls[name] > 0, f"{name} never ran on the triton path: {dict(calls)}"
    worst = max((g - w).abs().max().item() for g, w in zip(got, want))
    print(f"{kind}: max abs logit diff {worst:.2e} over {len(got)} steps, kernel calls {dict(calls)}")
    assert worst < LOGIT_BOUND, f"{kind}: logits differ by {worst:.2e} (bound {LOGIT_BOUND})"
    assert got_tokens == want_tokens
    if kind == "lora":  # the adapters change the output: the update was applied, not skipped
        base_tokens, _ = greedy(ref, ("", ""))
        assert base_tokens != want_tokens
