"""The MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE) against transformers in fp32: random-weight HF
directories written by transformers' own config and model classes (3 layers, 6-8 experts, hidden 64).

Per family: teacher-forced logits within 1e-3 over prompts of 7..600 tokens in 64-token chunks; greedy
tokens equal to transformers' argmax at every step, alone and in one continuous batch (engine.LLM);
the in-process prefill/decode pair (tests/pd_harness.py) equal to colocated; which layers are sparse
equal to transformers' modules; config fields refused by name. Then one real PD stack (router,
prefill with TP 2 ranks, decode, colocated: separate processes, UCX) on Qwen2-MoE, equal to colocated.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import LLM
from engine.models.moe import SparseMoE
from engine.sampling.params import SamplingParams
from tests.pd_harness import pd_equals_colocated, router_equals_colocated, router_stack

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=1024)
FAMILIES = {  # model_type -> (transformers class names, config fields)
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(intermediate_size=48, num_local_experts=6, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",  # shared expert, no renormalisation, a dense layer
                  dict(intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",  # top-3 renormalised, q/k norms, tied, a dense layer
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
                       norm_topk_prob=True, head_dim=32, mlp_only_layers=[0], tie_word_embeddings=True)),
}
LENGTHS = (7, 33, 150, 600)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def hf_model(kind: str, **overrides: object):  # noqa: ANN201
    """transformers' model of `kind`, weights N(0, 0.1) from a fixed seed, eval mode."""
    import transformers

    cfg_name, model_name, fields = FAMILIES[kind]
    cfg = getattr(transformers, cfg_name)(**(BASE | fields | overrides))
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:  # norms stay at one
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def write_model(kind: str, dst: Path):  # noqa: ANN201
    """An HF directory of `kind` (save_pretrained, fp32) with the embedded model's tokenizer."""
    from engine.models.embedded import resolve_model_path

    model = hf_model(kind)
    model.save_pretrained(dst)
    src = resolve_model_path("embedded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(1)
    kind = request.param
    dst = tmp_path_factory.mktemp(kind)
    hf = write_model(kind, dst)
    cfg = EngineConfig(model=str(dst), max_total_tokens=4096, host_kv_tokens=512, page_size=16,
                       chunked_prefill_size=64, max_prefill_tokens=256, threads=1)
    llm = LLM(cfg)
    return kind, hf, llm, cfg


def test_loads_as_moe(family):
    kind, _, llm, _ = family
    model = llm.runner.model
    assert llm.runner.model_cfg.model_type == kind
    blocks = [m for m in model.modules() if isinstance(m, SparseMoE)]
    assert len(blocks) == sum(llm.runner.model_cfg.moe.sparse_layers) >= 2
    assert all(b.packed is not None and b.w13.numel() == 0 for b in blocks)  # packed once, not held twice


def test_teacher_forced_logits_match_transformers(family):
    _, hf, llm, _ = family
    for n in LENGTHS:
        ids = _prompt(n, n)
        ours = llm.prompt_logits(ids, chunk=64)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        diff = (ours - ref).abs().max().item()
        assert diff < 1e-3, f"prompt of {n} tokens: max abs logit diff {diff}"


def test_greedy_alone_and_batched_match_transformers(family):
    _, hf, llm, _ = family
    prompts = [_prompt(100 + n, n) for n in LENGTHS[:3]]
    alone = [llm.generate([ids], GREEDY)[0].output_ids for ids in prompts]
    for ids, out in zip(prompts, alone):
        seq = ids + out
        with torch.no_grad():
            argmax = hf(torch.tensor([seq[:-1]])).logits[0].argmax(-1).tolist()
        assert argmax[len(ids) - 1:] == out, "greedy tokens differ from transformers' argmax"
    batched = [c.output_ids for c in llm.generate(prompts, GREEDY)]
    assert batched == alone
    assert llm.scheduler.kv.all_free()


def test_pd_in_process_equals_colocated(family):
    pd_equals_colocated(family[3], [_prompt(7, 21), _prompt(8, 70)], GREEDY)


@pytest.mark.parametrize("kind,overrides", [
    ("qwen3_moe", dict(decoder_sparse_step=2)), ("qwen3_moe", dict(mlp_only_layers=[0, 2])),
    ("qwen2_moe", dict(decoder_sparse_step=3, mlp_only_layers=[2])), ("mixtral", {})])
def test_sparse_layers_match_transformers_modules(kind, overrides):
    hf = hf_model(kind, **overrides)
    want = tuple(type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers)
    raw = json.loads(hf.config.to_json_string())
    from engine.models.registry import family

    assert family(kind).config(raw).moe.sparse_layers == want


@pytest.mark.parametrize("kind,field,value", [
    ("mixtral", "hidden_act", "gelu"), ("qwen2_moe", "num_experts_per_tok", 9),
    ("qwen3_moe", "decoder_sparse_step", 0), ("qwen3_moe", "mlp_only_layers", "all"),
    ("qwen2_moe", "moe_intermediate_size", None)])
def test_unsupported_fields_are_refused_by_name(kind, field, value, tmp_path):
    import transformers

    cfg_name, _, fields = FAMILIES[kind]
    raw = json.loads(getattr(transformers, cfg_name)(**(BASE | fields)).to_json_string()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dir(tmp_path)


def test_a_lora_adapter_on_the_experts_is_refused_by_name(tmp_path):
    """An adapter targeting the MLP of an MoE model says why it cannot be served (not a missing weight)."""
    import transformers

    from engine.extras.lora.adapter import load_adapter

    cfg_name, _, fields = FAMILIES["qwen2_moe"]
    (tmp_path / "config.json").write_text(getattr(transformers, cfg_name)(**(BASE | fields)).to_json_string())
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8,
                                                             "target_modules": ["q_proj", "gate_proj"]}))
    with pytest.raises(ValueError, match=r"\['gate_proj'\] are the MLP of a mixture-of-experts model"):
        load_adapter("moe-mlp", adapter, ModelConfig.from_dir(tmp_path), max_rank=16)


# ---- one real PD stack through the router ---------------------------------------------------------

@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory):  # noqa: ANN001, ANN201
    """Qwen2-MoE (shared expert): colocated, a prefill of 2 TP ranks, a decode, the router over them."""
    model = tmp_path_factory.mktemp("moe_pd")
    write_model("qwen2_moe", model)
    with router_stack(model, ("--tp", "2")) as procs:
        yield procs


@pytest.mark.slow
def test_real_pd_through_router_equals_colocated(pd_stack):
    router_equals_colocated(pd_stack, [_prompt(1, 13), _prompt(2, 45)])
