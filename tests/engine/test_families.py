"""Model families (issue 36): the registry, Qwen3 (q/k norms, explicit head_dim, tied and untied), YaRN
rope on Llama/Qwen2/Qwen3, refused configs, and the dense layers' tensor-parallel slicing.

Each family is a random-weight directory written by transformers' own config class (fp32, 2-3
layers, hidden 64) and checked against that transformers model: teacher-forced logits within 1e-3
over prompts of 7..600 tokens prefilled in 64-token chunks over the paged cache (YaRN: far beyond
original_max_position_embeddings), greedy tokens identical alone and batched; Qwen3 through the
in-process PD pair equal to colocated.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed.tp import TPGroup
from engine.engine import LLM
from engine.sampling.params import SamplingParams
from tests.hf_oracle import hf_greedy

pytestmark = pytest.mark.slow

LENGTHS = [7, 33, 130, 300, 600]
CHUNK = 64
SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)


def _yarn(theta: float, **kw: object) -> dict:
    return {"rope_type": "yarn", "rope_theta": theta, **kw}


def _config(name: str):  # noqa: ANN202
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if name == "qwen3-tied":  # head_dim 32 != hidden / heads
        return Qwen3Config(num_hidden_layers=2, head_dim=32, tie_word_embeddings=True, **SMALL)
    if name == "qwen3-untied-yarn":  # q/k/v/o biases, explicit attention factor
        return Qwen3Config(num_hidden_layers=3, head_dim=16, tie_word_embeddings=False, attention_bias=True,
                           rope_parameters=_yarn(1e6, factor=4.0, original_max_position_embeddings=256,
                                                 attention_factor=1.2), **SMALL)
    if name == "llama-yarn":  # default attention factor 0.1 ln(8) + 1
        return LlamaConfig(num_hidden_layers=2, tie_word_embeddings=False,
                           rope_parameters=_yarn(10000.0, factor=8.0, original_max_position_embeddings=128), **SMALL)
    assert name == "qwen2-yarn"  # mscale / mscale_all_dim, betas, no truncation
    return Qwen2Config(num_hidden_layers=2, tie_word_embeddings=False,
                       rope_parameters=_yarn(10000.0, factor=16.0, original_max_position_embeddings=64, beta_fast=16,
                                             beta_slow=2, mscale=1.0, mscale_all_dim=0.5, truncate=False), **SMALL)


FAMILIES = ["qwen3-tied", "qwen3-untied-yarn", "llama-yarn", "qwen2-yarn"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, hf_checkpoint):
    path, hf = hf_checkpoint(_config(request.param), request.param)
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=4096, page_size=16, chunked_prefill_size=CHUNK,
                           threads=1))
    return request.param, path, hf, llm


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, SMALL["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]



def test_config_is_read_by_the_family(family):
    name, path, _, llm = family
    cfg = ModelConfig.from_dir(path)
    assert cfg.model_type == name.split("-")[0]
    assert cfg.qk_norm == name.startswith("qwen3")
    assert cfg.head_dim == {"qwen3-tied": 32}.get(name, 16)
    assert cfg.tie_embeddings == (name == "qwen3-tied")
    assert (cfg.rope_scaling or {}).get("rope_type", "default") == ("yarn" if "yarn" in name else "default")
    assert llm.runner.model.local_kv_heads == 2 and llm.runner.model.local_heads == 4


def test_teacher_forced_logits_match_transformers(family):
    name, _, hf, llm = family
    old = (llm.runner.model_cfg.rope_scaling or {}).get("original_max_position_embeddings", 0)
    assert max(LENGTHS) > 2 * old  # YaRN: positions far beyond the original context
    worst = {}
    for ids in _prompts():
        ours = llm.prompt_logits(ids, chunk=CHUNK)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ref.abs().max() > 1.0  # logits large enough for 1e-3 to mean something
        worst[len(ids)] = (ours - ref).abs().max().item()
    assert max(worst.values()) < 1e-3, f"{name}: max abs logit diff by prompt length {worst}"


def test_torch_attention_path_matches_too(hf_checkpoint):
    """The torch rope + store path (no native kernels: bf16/fp16, CUDA) with Qwen3's q/k norms and YaRN."""
    path, hf = hf_checkpoint(_config("qwen3-untied-yarn"), "qwen3-torch-path")
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=2048, page_size=16, chunked_prefill_size=CHUNK,
                           attention_backend="torch", threads=1))
    ids = _prompts()[-1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (llm.prompt_logits(ids, chunk=CHUNK) - ref).abs().max().item() < 1e-3


def test_qwen3_sliding_window_rule():
    """Qwen3 reads windows as Qwen2 does: from max_window_layers on, when use_sliding_window."""
    from engine.models.qwen3 import config

    raw = {"model_type": "qwen3", "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100,
           "use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1}
    assert config(raw).sliding_windows == (0, 48, 48)
    assert config(raw | {"use_sliding_window": False}).sliding_windows == ()


def test_greedy_matches_transformers_alone_and_batched(family):
    _, _, hf, llm = family
    prompts = [p for p in _prompts() if len(p) in (7, 130, 600)]
    want = hf_greedy(hf, prompts, 24)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    assert [llm.generate([ids], greedy)[0].output_ids for ids in prompts] == want
    assert [c.output_ids for c in llm.generate(prompts, greedy)] == want
    assert llm.scheduler.kv.all_free()


@pytest.mark.parametrize("change,field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "low_freq_factor": 1.0}}, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": -2.0}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
])
def test_configs_it_cannot_run_exactly_are_refused(tmp_path, change, field):
    cfg = {"model_type": "qwen3", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100} | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig.from_dir(tmp_path)


def test_llama_mlp_bias_is_refused(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
           "intermediate_size": 128, "vocab_size": 100, "mlp_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("rope", [
    _yarn(10000.0, factor=4.0, original_max_position_embeddings=128),
    _yarn(1e6, factor=32.0, original_max_position_embeddings=4096, beta_fast=8, beta_slow=0.5),
    _yarn(10000.0, factor=8.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=0.707),
    _yarn(10000.0, factor=3.0, original_max_position_embeddings=100, attention_factor=0.9, truncate=False),
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
])
def test_rope_frequencies_equal_transformers(rope):
    """inv_freq and the attention factor, against transformers' own rope init function."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.models.rope import rope_params

    hf_cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, rope_parameters=dict(rope),
                         max_position_embeddings=4096)
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu")
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    inv, factor = rope_params(64, rope["rope_theta"], scaling)
    assert factor == pytest.approx(want_factor, rel=1e-12)
    assert torch.allclose(inv, want_inv.float(), rtol=1e-6, atol=0)


def test_qwen3_pd_pair_equals_colocated(hf_checkpoint):
    from tests.pd_harness import PDPair, colocated_tokens

    path, _ = hf_checkpoint(_config("qwen3-tied"), "qwen3-pd")
    cfg = EngineConfig(model=str(path), max_total_tokens=2048, host_kv_tokens=256, page_size=16,
                       chunked_prefill_size=CHUNK, max_prefill_tokens=2 * CHUNK, threads=1)
    prompts = [p for p in _prompts() if len(p) <= 300]
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16, ignore_eos=True)
    want = colocated_tokens(cfg, prompts, sampling)
    pair = PDPair(cfg)
    try:
        tokens, d_done, p_done = pair.run(prompts, sampling)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert tokens == want and all(len(t) == 16 for t in tokens.values())
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
    finally:
        pair.close()


@pytest.mark.parametrize("size", [2, 4])
def test_tp_ranks_weights_concatenate_to_the_full_weights(hf_checkpoint, size):
    """Every rank's weights() has exactly its Model's parameter shapes, and the ranks' slices put back
    together are the full checkpoint: q/o/gate/up/down by concatenation, KV heads replicated when the
    group outnumbers them (size 4, 2 KV heads), o's bias and the LM head on rank 0 only."""
    from safetensors.torch import load_file

    from engine.models.registry import family

    path, _ = hf_checkpoint(_config("qwen3-untied-yarn"), f"qwen3-tp{size}")
    cfg = ModelConfig.from_dir(path)
    fam, raw = family(cfg.model_type), load_file(str(path / "model.safetensors"))
    full = fam.weights(raw, cfg, TPGroup())
    ranks = [fam.weights(raw, cfg, TPGroup(r, size)) for r in range(size)]
    d, hq, hkv = cfg.head_dim, 4 // size, max(1, 2 // size)
    for r, w in enumerate(ranks):
        with torch.device("meta"):
            model = fam.Model(cfg, 8, TPGroup(r, size))
        assert {n: tuple(p.shape) for n, p in model.named_parameters()} == {n: tuple(t.shape) for n, t in w.items()}
        assert (model.local_heads, model.local_kv_heads) == (hq, hkv)
        assert ("lm_head.weight" in w) == (r == 0)
        assert torch.equal(w["embed_tokens.weight"], full["embed_tokens.weight"])
    step = max(1, size // 2)  # ranks sharing one KV head
    for i in range(cfg.num_layers):
        a, m = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
        for kind in ("weight", "bias"):
            parts = [w[a + f"qkv_proj.{kind}"].split([hq * d, hkv * d, hkv * d]) for w in ranks]
            for r in range(size):  # replicated KV heads are equal
                assert torch.equal(parts[r][1], parts[r - r % step][1])
            got = torch.cat([torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts[::step]]),
                             torch.cat([p[2] for p in parts[::step]])])
            assert torch.equal(got, full[a + f"qkv_proj.{kind}"])
        assert torch.equal(torch.cat([w[a + "o_proj.weight"] for w in ranks], 1), full[a + "o_proj.weight"])
        assert [a + "o_proj.bias" in w for w in ranks] == [True] + [False] * (size - 1)
        assert all(torch.equal(w[a + "k_norm.weight"], full[a + "k_norm.weight"]) for w in ranks)
        gate_up = [w[m + "gate_up_proj.weight"].chunk(2) for w in ranks]
        got = torch.cat([g for g, _ in gate_up] + [u for _, u in gate_up])
        assert torch.equal(got, full[m + "gate_up_proj.weight"])
        assert torch.equal(torch.cat([w[m + "down_proj.weight"] for w in ranks], 1), full[m + "down_proj.weight"])


def test_a_rank_other_than_0_loads_without_the_lm_head(hf_checkpoint):
    from engine.models.loader import load_model

    path, _ = hf_checkpoint(_config("qwen3-untied-yarn"), "qwen3-rank1")
    cfg = ModelConfig.from_dir(path)
    model = load_model(path, cfg, "float32", "cpu", 64, tp=TPGroup(1, 2))
    assert model.lm_head is None and model.lm_head_weight() is None and model.lm_packed is None
    assert (model.local_heads, model.local_kv_heads) == (2, 1)
    assert model.layers[0].self_attn.o_proj.bias is None  # the row-parallel bias is rank 0's
    with pytest.raises(RuntimeError, match="rank 0"):
        model.logits(torch.zeros(1, 64))


@pytest.mark.parametrize("change,size,field", [
    ({}, 3, "num_attention_heads"),
    ({"intermediate_size": 130}, 4, "intermediate_size"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2, "num_key_value_heads"),
])
def test_tp_size_that_does_not_divide_is_refused(change, size, field):
    from engine.models.qwen3 import Model, config

    cfg = config({"model_type": "qwen3", "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "hidden_size": 64, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100} | change)
    with pytest.raises(ValueError, match=field), torch.device("meta"):
        Model(cfg, 8, TPGroup(0, size))


class _Partial(TPGroup):
    """A rank whose all-reduce returns its own partial sum (the test adds the ranks up)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_row_parallel_partials_sum_to_the_full_mlp():
    """Rank 0 adds the residual, the others only their partial product: the partials sum to the full MLP."""
    from engine.models.checkpoint import Checkpoint, dense_mlp_weights
    from engine.models.layers import DenseMLP

    g = torch.Generator().manual_seed(0)
    raw = {f"mlp.{n}_proj.weight": torch.randn(shape, generator=g)
           for n, shape in (("gate", (128, 64)), ("up", (128, 64)), ("down", (64, 128)))}
    x, residual = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g)

    def block(tp: TPGroup) -> DenseMLP:
        mlp = DenseMLP(64, 128, tp)
        mlp.gate_up_proj.packed = mlp.down_proj.packed = None
        mlp.load_state_dict(dense_mlp_weights(Checkpoint(raw), "mlp.", "", 128, tp))
        return mlp

    with torch.no_grad():
        want = block(TPGroup())(x, residual)
        got = sum(block(_Partial(r, 2))(x, residual) for r in range(2))
    # equal up to fp32 rounding: values reach ~1e3, so the bound is relative (the split changes the summation order)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4) and not torch.allclose(want, residual, atol=1e-2)
