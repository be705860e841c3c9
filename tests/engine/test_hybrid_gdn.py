"""The Gated DeltaNet hybrid families (engine/models/qwen3_next.py, qwen3_5.py) against transformers in fp32.

Each family is a tiny random-weight model built from transformers' own config class (hidden 64, 4-6 layers,
linear and full-attention layers interleaved, MoE with a gated shared expert where the family has one),
saved with save_pretrained; the transformers model is the oracle. The engine runs through ModelRunner and
forward_segments, each request holding KV pages and one recurrent-state slot (Segment.slot):

- teacher-forced logits within 1e-3 over prompts up to 700 tokens prefilled in 64- or 128-token chunks
  (the conv and recurrent states carried from chunk to chunk; some value heads decay slowly, so a state
  lost at a chunk boundary shows);
- decoding one token at a time after a prefill equals the teacher-forced logits at those positions;
- two requests of different lengths in one forward (prompt chunks and a one-token step mixed, two slots)
  equal each run alone;
- the multimodal wrappers (qwen3_5 with its vision tower skipped; qwen3_5_moe with fused expert tensors,
  `mtp.*` weights) load as their language model;
- tensor parallelism: every rank's weights fit its Model, the Gated DeltaNet's per-rank partial outputs
  sum to the whole layer's, and two ranks run in two threads (an in-process all-reduce) equal
  transformers; served over TP=2 (a spawned rank over gloo, slow) the logits equal transformers and a
  continuous batch that retracts (each rank saves and reloads its heads' state) and forks n > 1 choices
  (each rank copies its slot) gives the tokens of one rank;
- config fields the engine cannot honour are refused by name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.engine import LLM
from engine.forward.forward_batch import LOGITS_ALL, LOGITS_LAST, Segment, forward_segments
from engine.kvcache.memory import pages_for
from engine.models.layers import ForwardContext
from engine.models.moe import SparseMoE
from engine.models.qwen3_next import GatedDeltaNet
from engine.models.registry import family as family_module
from engine.recurrent.batch import StateBatch
from engine.recurrent.state_pool import StatePool, StateSpec
from engine.request import LogprobState, Req
from engine.request_groups import LogprobParams
from engine.sampling.params import SamplingParams
from engine.scheduling.parallel import add_choices

VOCAB = 256
L, F = "linear_attention", "full_attention"
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6)
FAMILIES = {  # model_type -> (transformers config class, fields)
    # full attention every 3rd layer, YaRN over the rotary half of each head, top-2 renormalised, layer 2 dense
    "qwen3_next": ("Qwen3NextConfig", dict(
        num_hidden_layers=6, full_attention_interval=3, intermediate_size=96, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[2], **MOE,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 512, "partial_rotary_factor": 0.5})),
    # attention first (KV index 0 is layer 0), tied embeddings, mrope fields, the default quarter rotary
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(
        num_hidden_layers=5, layer_types=[F, L, L, F, L], intermediate_size=96, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})),
    # every layer sparse, top-3 always renormalised
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=4, num_experts_per_tok=3, **MOE)),
}
CHUNKS = {9: 64, 300: 128, 700: 64}  # prompt length -> prefill chunk


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _hf_config(kind: str, **overrides: object):  # noqa: ANN202
    import transformers

    cls, fields = FAMILIES[kind]
    return getattr(transformers, cls)(**(BASE | fields | overrides))


def _randomize(model) -> None:  # noqa: ANN001
    """Weights N(0, 0.1) from a fixed seed; norms around their neutral value (zero-centred ones around 0,
    the gated norm around 1); A_log so that value heads decay from fast to very slow (long memory)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) - 0.5)
            elif name.endswith("A_log"):
                p.copy_(torch.linspace(-7.0, 1.0, p.numel()))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def write_model(kind: str, dst: Path):  # noqa: ANN201
    """transformers' causal LM of `kind` (eval, fp32, randomized), saved to dst; returns the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(kind), attn_implementation="eager",
                                             dtype=torch.float32).eval()
    _randomize(model)
    model.save_pretrained(dst)
    return model


def runner_for(path: Path):  # noqa: ANN201
    from engine.forward.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(path), max_total_tokens=4096, page_size=16, max_running_requests=4,
                                    threads=1))


class Request:
    """One request's KV pages and state slot on a runner."""

    def __init__(self, runner, n: int) -> None:  # noqa: ANN001
        self.runner = runner
        self.pages = runner.pool.allocator.allocate(pages_for(n, runner.page_size))
        self.slot = runner.states.allocate(1)[0]

    def seg(self, start: int, tokens: list[int], logits: int = LOGITS_ALL) -> Segment:
        return Segment(self.pages, start, tokens, logits, slot=self.slot)

    def free(self) -> None:
        self.runner.pool.allocator.free(self.pages)
        self.runner.states.free([self.slot])


def prefill(runner, ids: list[int], chunk: int) -> torch.Tensor:  # noqa: ANN001
    """Teacher-forced fp32 logits [n, V], the prompt run in `chunk`-token forwards."""
    req = Request(runner, len(ids))
    try:
        return torch.cat([forward_segments(runner, [req.seg(s, ids[s : s + chunk])]).logits[0]
                          for s in range(0, len(ids), chunk)])
    finally:
        req.free()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(1)
    kind = request.param
    path = tmp_path_factory.mktemp(kind)
    hf = write_model(kind, path)
    return kind, path, hf, runner_for(path)


def test_layers_pool_and_state_follow_the_config(family):
    kind, _, hf, runner = family
    mc = runner.model_cfg
    kinds = hf.config.layer_types
    assert mc.attention_layers == tuple(i for i, k in enumerate(kinds) if k == F)
    assert mc.hybrid.linear_layers == tuple(i for i, k in enumerate(kinds) if k == L)
    assert runner.pool.buffer.shape[1] == mc.num_kv_layers == len(mc.attention_layers)  # KV for attention only
    conv = (2 * 2 * 16 + 4 * 8, 3)  # q|k|v channels (2 key heads of 16, 4 value heads of 8), kernel 4 - 1
    want = {}
    for i in mc.hybrid.linear_layers:
        want |= {f"{i}.conv": (conv, torch.float32), f"{i}.ssm": ((4, 16, 8), torch.float32)}
    assert {p.name: (p.shape, p.dtype) for p in runner.states.spec.parts} == want
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in runner.model.layers]
    assert sparse == [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert (mc.moe is not None) == any(sparse) and (kind == "qwen3_5_text") == (not any(sparse))
    assert runner.model.local_heads == 4 and runner.model.local_kv_heads == 2


def test_teacher_forced_logits_match_transformers(family):
    kind, _, hf, runner = family
    worst = {}
    for n, chunk in CHUNKS.items():
        ids = _prompt(n, n)
        ref = hf_logits(hf, ids)
        assert ref.abs().max() > 1.0  # logits large enough for 1e-3 to mean something
        worst[n] = (prefill(runner, ids, chunk) - ref).abs().max().item()
    print(f"{kind}: max abs logit diff by prompt length {worst}")
    assert max(worst.values()) < 1e-3, f"{kind}: max abs logit diff by prompt length {worst}"


def test_decode_steps_equal_teacher_forced(family):
    """A 150-token prefill (64-token chunks), then 12 one-token steps: each step's logits are the
    teacher-forced logits of that position (transformers' and the engine's own)."""
    _, _, hf, runner = family
    ids, n0 = _prompt(5, 162), 150
    ref, forced = hf_logits(hf, ids), prefill(runner, ids, 64)
    req = Request(runner, len(ids))
    try:
        for s in range(0, n0, 64):
            forward_segments(runner, [req.seg(s, ids[s : min(s + 64, n0)], LOGITS_LAST)])
        steps = torch.stack([forward_segments(runner, [req.seg(p, [ids[p]], LOGITS_LAST)]).logits[0]
                             for p in range(n0, len(ids))])
    finally:
        req.free()
    assert (steps - ref[n0:]).abs().max().item() < 1e-3
    assert (steps - forced[n0:]).abs().max().item() < 1e-4


def test_two_requests_in_one_forward_equal_each_alone(family):
    """Request A (200 tokens) and B (90) share every forward: prompt chunks side by side, then B's last
    token as a one-token step beside A's last chunk. Each equals its own run alone, and transformers."""
    _, _, hf, runner = family
    a_ids, b_ids = _prompt(11, 200), _prompt(12, 90)
    alone = [prefill(runner, ids, 64) for ids in (a_ids, b_ids)]
    a, b = Request(runner, 200), Request(runner, 90)
    got: list[list[torch.Tensor]] = [[], []]
    try:
        for (a0, a1), (b0, b1) in (((0, 64), (0, 40)), ((64, 128), (40, 89)), ((128, 200), (89, 90))):
            out = forward_segments(runner, [a.seg(a0, a_ids[a0:a1]), b.seg(b0, b_ids[b0:b1])]).logits
            got[0].append(out[0])
            got[1].append(out[1])
    finally:
        a.free()
        b.free()
    for ids, one, both in zip((a_ids, b_ids), alone, got):
        both = torch.cat(both)
        assert (both - one).abs().max().item() < 1e-4
        assert (both - hf_logits(hf, ids)).abs().max().item() < 1e-3


# ---- the multimodal wrappers ------------------------------------------------------------------------

def test_qwen3_5_wrapper_loads_its_language_model_and_skips_the_vision_tower(tmp_path, caplog):
    import transformers

    text = _hf_config("qwen3_5_text").to_dict()
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)).eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    assert any(n.startswith("model.visual.") for n in load_file(str(tmp_path / "model.safetensors")))
    with caplog.at_level(logging.INFO, logger="engine.models.qwen3_next"):
        runner = runner_for(tmp_path)
    assert "vision tower" in caplog.text
    assert runner.model_cfg.model_type == "qwen3_5" and runner.model_cfg.tie_embeddings
    ids = _prompt(3, 140)
    assert (prefill(runner, ids, 64) - hf_logits(hf, ids)).abs().max().item() < 1e-3


def test_qwen3_5_moe_wrapper_with_fused_experts_and_mtp(tmp_path):
    """A qwen3_5_moe_text model repackaged as Qwen3.5-MoE ships it: decoder under model.language_model.,
    each layer's experts fused (gate_up_proj [E, 2I, H], down_proj [E, H, I]), mtp.* and vision weights."""
    path = tmp_path / "text"
    hf = write_model("qwen3_5_moe_text", path)
    raw = load_file(str(path / "model.safetensors"))
    out = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t for n, t in raw.items()}
    experts = 6
    for i in range(4):
        p = f"model.language_model.layers.{i}.mlp.experts."
        gate_up = [torch.cat([out.pop(f"{p}{e}.gate_proj.weight"), out.pop(f"{p}{e}.up_proj.weight")])
                   for e in range(experts)]
        out[p + "gate_up_proj"] = torch.stack(gate_up)
        out[p + "down_proj"] = torch.stack([out.pop(f"{p}{e}.down_proj.weight") for e in range(experts)])
    out["mtp.fc.weight"] = torch.zeros(64, 128)
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    wrapper = tmp_path / "wrapper"
    wrapper.mkdir()
    save_file(out, str(wrapper / "model.safetensors"))
    text = json.loads((path / "config.json").read_text())
    (wrapper / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": text,
                                                     "vision_config": {}, "tie_word_embeddings": False}))
    wrapped = runner_for(wrapper)
    assert wrapped.model_cfg.moe == ModelConfig.from_dir(path).moe
    assert all(isinstance(layer.mlp, SparseMoE) for layer in wrapped.model.layers)
    ids = _prompt(4, 130)
    assert (prefill(wrapped, ids, 64) - hf_logits(hf, ids)).abs().max().item() < 1e-3


# ---- tensor parallelism -----------------------------------------------------------------------------

class _Partial(TPGroup):
    """A rank whose all-reduce returns its own partial sum (the test adds the ranks up)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_tp_rank_weights_fit_and_gdn_partials_sum_to_the_layer(family):
    kind, path, _, _ = family
    cfg = ModelConfig.from_dir(path)
    fam, raw = family_module(cfg.model_type), load_file(str(path / "model.safetensors"))
    for r in range(2):
        w = fam.weights(raw, cfg, TPGroup(r, 2))
        with torch.device("meta"):
            model = fam.Model(cfg, 8, TPGroup(r, 2))
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: tuple(t.shape) for n, t in w.items()}
        assert [p.shape for p in model.state_spec().parts][:2] == [(2 * 16 + 2 * 8, 3), (2, 16, 8)]  # half the heads
    layer = cfg.hybrid.linear_layers[-1]
    prefix = f"layers.{layer}.linear_attn."
    g = torch.Generator().manual_seed(0)
    x, residual = torch.randn(50, 64, generator=g), torch.randn(50, 64, generator=g)

    def run(tp: TPGroup) -> torch.Tensor:
        m = GatedDeltaNet(cfg, layer, tp)
        w = fam.weights(raw, cfg, tp)
        m.load_state_dict({n[len(prefix):]: t for n, t in w.items() if n.startswith(prefix)})
        pool = StatePool(StateSpec(m.state_parts()), 2, "cpu")
        ctx = ForwardContext(pool=None, backend=None, meta=None, out_page=None, out_offset=None,
                             state=StateBatch(pool, torch.tensor([1, 2]), [30, 20], [False, False]))
        with torch.inference_mode():
            return m(x, ctx, residual)

    full = run(SINGLE)
    parts = run(_Partial(0, 2)) + run(_Partial(1, 2))
    assert torch.allclose(parts, full, atol=1e-5) and not torch.allclose(full, residual, atol=1e-2)


def test_tp_size_that_does_not_divide_the_key_heads_is_refused():
    from engine.models.qwen3_next import Model, config

    raw = json.loads(_hf_config("qwen3_next").to_json_string())
    with pytest.raises(ValueError, match="linear_num_key_heads"), torch.device("meta"):
        Model(config(raw), 8, TPGroup(0, 4))  # 4 attention heads split, 2 KV heads replicated, 2 key heads not


# ---- config refusals --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,change,field", [
    ("qwen3_next", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_next", {"attention_bias": True}, "attention_bias"),
    ("qwen3_next", {"linear_conv_kernel_dim": 1}, "linear_conv_kernel_dim"),
    ("qwen3_next", {"linear_num_value_heads": 3}, "linear_num_value_heads"),
    ("qwen3_next", {"layer_types": [L] * 6}, "layer_types"),
    ("qwen3_next", {"layer_types": [L, F]}, "layer_types"),
    ("qwen3_next", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen3_next", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_scaling.rope_type"),
    ("qwen3_next", {"partial_rotary_factor": 0.25}, "partial_rotary_factor"),  # rope_parameters says 0.5
    ("qwen3_5_text", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.01}},
     "partial_rotary_factor"),
    ("qwen3_5_text", {"model_type": "qwen3_5", "text_config": None}, "text_config"),
    ("qwen3_5_text", {"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_text"}},
     "text_config.model_type"),
])
def test_configs_it_cannot_run_exactly_are_refused_by_name(tmp_path, kind, change, field):
    raw = json.loads(_hf_config(kind).to_json_string()) | change
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_dir(tmp_path)


def test_layer_kinds_and_sparse_layers_match_transformers():
    """full_attention_interval and decoder_sparse_step / mlp_only_layers as transformers builds the modules."""
    from transformers import Qwen3NextForCausalLM

    from engine.models.qwen3_next import config

    hf_cfg = _hf_config("qwen3_next", full_attention_interval=2, decoder_sparse_step=2, mlp_only_layers=[3])
    hf = Qwen3NextForCausalLM(hf_cfg)
    cfg = config(json.loads(hf_cfg.to_json_string()))
    assert cfg.attention_layers == tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer, "self_attn"))
    assert cfg.moe.sparse_layers == tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock")
                                          for layer in hf.model.layers)


class _Exchange:
    """Two threads' all-reduce: each rank deposits its partial sum, both add them up in rank order."""

    def __init__(self, size: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)


class _ThreadRank(TPGroup):
    """A TP rank running in a thread of this process; `group` is the shared _Exchange."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.group.parts[self.rank] = x.clone()
        self.group.barrier.wait()
        total = sum(self.group.parts[1:], self.group.parts[0].clone())
        self.group.barrier.wait()
        return x.copy_(total)


def test_tp2_model_matches_transformers(family):
    """Both ranks' Models (loaded by the loader with their weights: one key head of the Gated DeltaNet each,
    half the attention heads, half of every expert) run one forward per step in two threads, each with its
    own KV pool and state pool, all-reducing through _ThreadRank: prompt chunks, then one-token steps, equal
    transformers. (Serving with --tp > 1 is refused by the model runner for now; this is the model's part.)"""
    from engine.attention.base import build_metadata
    from engine.attention.registry import create_backend
    from engine.kvcache.memory import KVPool
    from engine.models.loader import load_model

    kind, path, hf, _ = family
    cfg = ModelConfig.from_dir(path)
    exchange, ps = _Exchange(2), 16
    ranks = []
    for r in range(2):
        model = load_model(path, cfg, "float32", "cpu", 1024, tp=_ThreadRank(r, 2, exchange))
        pool = KVPool(64, cfg.num_kv_layers, ps, model.local_kv_heads, cfg.head_dim, torch.float32, "cpu")
        ranks.append((model, pool, StatePool(model.state_spec(), 2, "cpu"), create_backend("cpu")))
    assert [p.shape for p in ranks[1][2].spec.parts][:2] == [(2 * 16 + 2 * 8, 3), (2, 16, 8)]  # half the heads
    ids, n0 = _prompt(21, 140), 130
    pages = list(range(1, pages_for(len(ids), ps) + 1))
    steps = [(s, ids[s : min(s + 64, n0)]) for s in range(0, n0, 64)] + [(p, [ids[p]]) for p in range(n0, len(ids))]
    logits: list[torch.Tensor] = []

    def step(r: int, start: int, tokens: list[int]) -> None:
        try:
            run(r, start, tokens)
        except BaseException:
            exchange.barrier.abort()  # the other rank stops waiting for this one
            raise

    def run(r: int, start: int, tokens: list[int]) -> None:
        model, pool, states, backend = ranks[r]
        pos = list(range(start, start + len(tokens)))
        meta = build_metadata([pages], [start + len(tokens)], [len(tokens)], ps, cfg.head_dim ** -0.5, "cpu")
        ctx = ForwardContext(pool=pool, backend=backend, meta=meta,
                             out_page=torch.tensor([pages[p // ps] for p in pos]),
                             out_offset=torch.tensor([p % ps for p in pos]), native=getattr(backend, "native", None),
                             state=StateBatch(states, torch.tensor([1]), [len(tokens)], [start > 0]))
        hidden = model(torch.tensor(tokens), torch.tensor(pos), ctx)
        if r == 0:
            logits.append(model.logits(hidden))

    for start, tokens in steps:
        threads = [threading.Thread(target=step, args=(r, start, tokens)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert len(logits) == len(steps)
    diff = (torch.cat(logits) - hf_logits(hf, ids)).abs().max().item()
    print(f"{kind} TP=2 vs transformers: max abs logit diff {diff:.2e}")
    assert diff < 1e-3


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):  # noqa: ANN001, ANN201
    """(transformers model, TP=2 rank-0 runner) of Qwen3-Next; rank 1 a real `spawn` process over gloo."""
    from tests.tp_spawn import tp_runner

    path = tmp_path_factory.mktemp("qwen3_next_tp2")
    hf = write_model("qwen3_next", path)
    cfg = EngineConfig(model=str(path), max_total_tokens=1024, page_size=16, max_running_requests=4, threads=1,
                       prefix_cache=True, state_snapshot_interval=64)  # 4 slots for requests + 4 for snapshots
    with tp_runner(cfg) as two:
        yield hf, two


@pytest.mark.slow
def test_tp2_matches_transformers(tp2):
    """TP=2 end to end: each rank holds one key head's Gated DeltaNet (and its state), half the attention
    heads, half of every expert; prompt chunks, then one-token steps, equal transformers."""
    hf, two = tp2
    local = two.local  # rank 0's ModelRunner: its state pool hands out the slots every rank uses
    assert [p.shape for p in local.states.spec.parts][:2] == [(2 * 16 + 2 * 8, 3), (2, 16, 8)]
    ids, n0 = _prompt(21, 140), 130
    ref = hf_logits(hf, ids)
    pages = local.pool.allocator.allocate(pages_for(len(ids), local.page_size))
    slot = local.states.allocate(1)[0]
    try:
        out = [forward_segments(two, [Segment(pages, s, ids[s : min(s + 64, n0)], LOGITS_ALL, slot=slot)]).logits[0]
               for s in range(0, n0, 64)]
        out += [forward_segments(two, [Segment(pages, p, [ids[p]], LOGITS_ALL, slot=slot)]).logits[0]
                for p in range(n0, len(ids))]
    finally:
        local.pool.allocator.free(pages)
        local.states.free([slot])
    diff = (torch.cat(out) - ref).abs().max().item()
    print(f"TP=2 vs transformers: max abs logit diff {diff:.2e}")
    assert diff < 1e-3


@pytest.mark.slow
def test_tp2_retraction_and_forks_move_every_ranks_state(tp2, tmp_path):
    """Retraction saves and reloads, and n > 1 copies, the state slot on both ranks (DrivenStatePool): a
    continuous batch too large for the TP=2 pool gives the same greedy tokens as one rank with room."""
    _, two = tp2
    params = SamplingParams(temperature=0.0, max_new_tokens=100, ignore_eos=True)
    prompts = [_prompt(40 + i, 150 + 20 * i) for i in range(6)]
    one = LLM(EngineConfig(model=two.cfg.model, max_total_tokens=4096, page_size=16, threads=1))
    want = [c.output_ids for c in one.generate(prompts, params)]
    # 1024 tokens of KV, 4 running at once of 150..250 + 100 tokens, admitted greedily: retraction is certain
    tight = LLM(dataclasses.replace(two.cfg, new_token_ratio=0.0, prefix_cache=False), runner=two)
    got = tight.generate(prompts, params)
    kv = tight.scheduler.kv
    assert kv.retractions > 0 and kv.reloads == kv.retractions
    assert [c.output_ids for c in got] == want
    parent = Req(rid="f", token_ids=prompts[0], sampling=SamplingParams(temperature=0.0, max_new_tokens=8,
                                                                      ignore_eos=True))
    add_choices(parent, 3)  # n = 3: the choices fork the parent's slot on both ranks
    chosen = [parent, *parent.choice.forks]
    for r in chosen[:1]:
        tight.scheduler.add(r)
    while not all(r.finished for r in chosen):
        tight.scheduler.step()
        tight.scheduler.drain()
    assert [r.output_ids for r in chosen] == [want[0][:8]] * 3
    assert kv.all_free() and kv.request_slots == 4


@pytest.mark.slow
def test_tp2_prefix_cache_snapshots_are_every_ranks(tp2):
    """The prefix cache's state snapshots are slot copies every rank makes (DrivenStatePool.copy): a prompt
    sharing a finished one's prefix restarts from the snapshot on both ranks, with one rank's tokens."""
    _, two = tp2
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    base = _prompt(60, 150)
    prompts = [base + _prompt(61, 10), base + _prompt(62, 25)]
    one = LLM(EngineConfig(model=two.cfg.model, max_total_tokens=4096, page_size=16, threads=1))
    cached = LLM(two.cfg, runner=two)
    kv = cached.scheduler.kv
    assert kv.snapshot_slots == 4 and kv.cache is not None

    def serve(llm: LLM) -> list[Req]:
        reqs = []
        for i, ids in enumerate(prompts):
            r = Req(rid=f"p{i}", token_ids=ids, sampling=params, logprobs=LogprobState(asked=LogprobParams(on=True)))
            llm.scheduler.add(r)
            while not r.finished:
                llm.scheduler.step()
                llm.scheduler.drain()
            reqs.append(r)
        return reqs

    want, got = serve(one), serve(cached)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    diff = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g.logprobs.output, w.logprobs.output))
    assert diff < 1e-3, diff  # a rank restarting from a state it never copied is off by far more
    # the first prompt (160 tokens) took a snapshot at its last page boundary before its last token, 144; the
    # second shares 150 tokens of it, nine whole pages: it restarts from that snapshot
    assert [r.kv.cached_tokens for r in got] == [0, 144]
    kv.flush()
    assert kv.all_free()
