"""DeepSeek-V2/V3 (MLA + DeepSeek MoE) against transformers in fp32: random-weight HF directories written by
transformers' own DeepseekV2/V3 classes (3 layers: one dense, two MoE; hidden 64, 4 heads).

V3: q LoRA, sigmoid routing with e_score_correction_bias, grouped top-k (4 groups, 2 kept), norm_topk_prob,
routed_scaling_factor 2.5, one shared expert, interleaved rope. V2: plain q, softmax group-limited routing,
two shared experts, YaRN rope with mscale / mscale_all_dim (the softmax scale gains mscale^2).

Per family: teacher-forced logits within 1e-3 over prompts of 7..600 tokens in 64-token chunks; greedy equal
to transformers' argmax, alone and batched; absorbed decode equal to the naive (expanded) decode; the latent
pool's bytes per token; retraction to host and prefix reuse; the in-process PD pair equal to colocated, with
decode-side prefix reuse; fields refused by name; MTP layers skipped.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from engine.attention.mla import mla_decode_torch
from engine.config import EngineConfig, ModelConfig
from engine.engine import LLM
from engine.forward.model_runner import ModelRunner
from engine.models.deepseek_mla import MLAAttention
from engine.sampling.params import SamplingParams
from tests.pd_harness import PDPair, colocated_tokens

VOCAB = 256
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, v_head_dim=24,
            qk_nope_head_dim=32, n_routed_experts=8, num_experts_per_tok=3, first_k_dense_replace=1,
            max_position_embeddings=1024)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", dict(q_lora_rank=48, n_shared_experts=1, routed_scaling_factor=2.5, n_group=4,
                                             topk_group=2, num_nextn_predict_layers=0)),
    "deepseek_v2": ("DeepseekV2Config", dict(
        q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                  "original_max_position_embeddings": 256, "mscale": 0.707,
                                                  "mscale_all_dim": 0.707})),
}
LENGTHS = (7, 33, 150, 600)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB, (n,), generator=g).tolist()


def hf_config(kind: str, **overrides: object):  # noqa: ANN201
    import transformers

    name, fields = FAMILIES[kind]
    return getattr(transformers, name)(**(BASE | fields | overrides))


def save_deepseek(kind: str, dst: Path):  # noqa: ANN201
    """A random-weight transformers model of `kind` saved fp32 to `dst` (with the embedded model's tokenizer):
    weights N(0, 0.2) (large enough that a wrong layer moves the logits well past 1e-3), norms in [0.5, 1.5],
    V3's e_score_correction_bias N(0, 0.1) (zero by default: a bias loaded wrong would not show). Returns the
    model, in eval mode: the oracle."""
    import shutil

    from transformers import AutoModelForCausalLM

    from engine.models.embedded import embedded_model_dir

    cfg = hf_config(kind)
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if n.endswith("norm.weight"):
                t.uniform_(0.5, 1.5, generator=g)
            elif n.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    model.save_pretrained(dst)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / f, dst / f)
    return model


def _cfg(path, **kw: object) -> EngineConfig:  # noqa: ANN001
    base = dict(model=str(path), max_total_tokens=4096, host_kv_tokens=512, page_size=16, chunked_prefill_size=64,
                max_prefill_tokens=256, threads=1)
    return EngineConfig(**(base | kw))


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp(request.param)
    hf = save_deepseek(request.param, path)
    cfg = _cfg(path)
    return request.param, hf, LLM(cfg), cfg


def test_teacher_forced_logits_match_transformers(family):
    _, hf, llm, _ = family
    worst = 0.0
    for n in LENGTHS:
        ids = _prompt(n, n)
        ours = llm.prompt_logits(ids, chunk=64)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (ours - ref).abs().max().item())
        assert worst < 1e-3, f"prompt of {n} tokens: max abs logit diff {worst}"
    print(f"max abs logit diff {worst:.2e}")


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


def test_absorbed_decode_equals_expanded_and_prefill_forms_agree(family):
    _, _, llm, _ = family
    prompts = [_prompt(5, 40), _prompt(6, 90)]
    layers = [m for m in llm.runner.model.modules() if isinstance(m, MLAAttention)]
    assert len(layers) == 3 and all(m.absorb for m in layers)
    want = [c.output_ids for c in llm.generate(prompts, GREEDY)]
    try:
        for m in layers:
            m.absorb = False
        assert [c.output_ids for c in llm.generate(prompts, GREEDY)] == want
    finally:
        for m in layers:
            m.absorb = True
    import engine.models.deepseek_mla as mla

    ids = _prompt(9, 100)
    ref = llm.prompt_logits(ids, chunk=64)
    form = mla.PREFILL_FORM
    mla.PREFILL_FORM = "absorbed" if form == "expanded" else "expanded"
    try:
        assert (llm.prompt_logits(ids, chunk=64) - ref).abs().max().item() < 1e-4
    finally:
        mla.PREFILL_FORM = form


def test_latent_pool_bytes_per_token(family):
    _, _, llm, cfg = family
    runner, mc = llm.runner, llm.runner.model_cfg
    per_token = (BASE["kv_lora_rank"] + BASE["qk_rope_head_dim"]) * BASE["num_hidden_layers"] * 4  # fp32
    buf = runner.pool.buffer
    assert tuple(buf.shape) == (cfg.num_pages, 3, 16, 48)
    assert buf.numel() * buf.element_size() == per_token * cfg.page_size * cfg.num_pages
    assert runner.server_info()["kv_bytes_per_token"] == per_token == runner.pool.page_bytes // cfg.page_size
    import dataclasses

    from service.pd import compat_info

    mine = compat_info(runner)
    assert mine.page_bytes == runner.pool.page_bytes and mine.kv_lora_rank == 32 and mine.qk_rope_head_dim == 16
    other = dataclasses.replace(mine, kv_lora_rank=64)  # another MLA geometry: the pair is refused (412) by name
    assert "kv_lora_rank" in mine.mismatch(other.to_dict())
    assert mc.mla.latent_dim == 48 and mc.num_kv_heads == 1


def test_decode_kernel_reference_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(9, 2, 4, 12, generator=g)  # [pages, layers, ps, R + R_] with R = 8, R_ = 4
    table = torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int32)
    lens = torch.tensor([10, 6], dtype=torch.int32)
    q, qp = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 4, generator=g)
    out = mla_decode_torch(q, qp, pool, 1, table, lens, 0.3, 8)
    for b, pages in enumerate(([1, 2, 3], [4, 5])):
        kv = torch.cat([pool[p, 1] for p in pages])[: lens[b]]
        p = torch.softmax((q[b] @ kv[:, :8].T + qp[b] @ kv[:, 8:].T) * 0.3, dim=-1)
        torch.testing.assert_close(out[b], p @ kv[:, :8])


def test_retraction_and_prefix_cache_unchanged(family):
    _, _, llm, cfg = family
    prompts = [_prompt(20 + i, 60) for i in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    want = [c.output_ids for c in llm.generate(prompts, params)]
    small_cfg = _cfg(cfg.model, max_total_tokens=256, host_kv_tokens=2048, new_token_ratio=0.0)
    small = LLM(small_cfg, runner=ModelRunner(small_cfg))
    assert [c.output_ids for c in small.generate(prompts, params)] == want
    kv = small.scheduler.kv
    assert kv.retractions > 0 and kv.reloads == kv.retractions and kv.all_free()
    cached_cfg = _cfg(cfg.model, prefix_cache=True)
    cached = LLM(cached_cfg, runner=ModelRunner(cached_cfg))
    shared = _prompt(30, 80)
    first = cached.generate([shared + [5, 6]], params)[0].output_ids
    second = cached.generate([shared + [7, 8, 9]], params)[0]
    assert cached.scheduler.kv.hit_tokens >= 64  # the shared prefix's whole pages came from the cache
    assert first == llm.generate([shared + [5, 6]], params)[0].output_ids
    assert second.output_ids == llm.generate([shared + [7, 8, 9]], params)[0].output_ids


def test_pd_in_process_equals_colocated_with_decode_reuse(family):
    _, _, _, cfg = family
    cfg = _cfg(cfg.model, prefix_cache=True)
    shared = _prompt(40, 70)
    turns = [[shared + [3, 4]], [shared + [9, 10, 11]]]
    want = [colocated_tokens(cfg, t, GREEDY)["r0"] for t in turns]
    pair = PDPair(cfg, decode_cache=True)
    try:
        got = []
        for i, t in enumerate(turns):
            tokens, d_done, p_done = pair.run(t, GREEDY, room_base=100 + 10 * i)
            assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
            got.append(tokens["r0"])
        assert got == want
        assert pair.decode.stats().counters.kv_pages_reused_on_decode >= 4  # 64 shared tokens on the decode
    finally:
        pair.close()


def _raw(kind: str, **fields: object) -> dict:
    return json.loads(hf_config(kind).to_json_string()) | fields


@pytest.mark.parametrize("kind,field,value", [
    ("deepseek_v2", "topk_method", "noaux_tc"), ("deepseek_v2", "norm_topk_prob", True),
    ("deepseek_v3", "scoring_func", "softmax"), ("deepseek_v3", "n_group", 3), ("deepseek_v3", "attention_bias", True),
    ("deepseek_v3", "qk_rope_head_dim", 15), ("deepseek_v2", "moe_layer_freq", 2)])
def test_unsupported_fields_are_refused_by_name(kind, field, value, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_raw(kind, **{field: value})))
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dir(tmp_path)


def test_mtp_layers_are_skipped_with_a_log_line(family, caplog):
    kind, _, llm, _ = family
    from engine.models import deepseek
    from engine.models.loader import _read_tensors

    raw = _read_tensors(llm.runner.model_path)
    raw["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP module after the 3 layers
    with caplog.at_level("INFO", logger="engine.models.deepseek"):
        params = deepseek.weights(raw, llm.runner.model_cfg)
    assert "multi-token-prediction" in caplog.text and not any(".3." in n for n in params)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_grouped_routing_matches_transformers_router(kind):
    """moe.route_grouped against transformers' own DeepseekV2/V3 TopkRouter on 300 random tokens."""
    import transformers.models.deepseek_v2.modeling_deepseek_v2 as v2
    import transformers.models.deepseek_v3.modeling_deepseek_v3 as v3

    from engine.models.moe import route_grouped

    hf_cfg = hf_config(kind)
    router = (v3.DeepseekV3TopkRouter if kind == "deepseek_v3" else v2.DeepseekV2TopkRouter)(hf_cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        if kind == "deepseek_v3":
            router.e_score_correction_bias.copy_(torch.randn(8, generator=g) * 0.3)
    from engine.models.deepseek import config

    spec = config(_raw(kind)).moe
    x = torch.randn(300, 64, generator=g)
    _, want_w, want_ids = router(x)
    bias = router.e_score_correction_bias if kind == "deepseek_v3" else None
    got_w, got_ids = route_grouped(x @ router.weight.T, spec, bias)
    order_w, order_g = want_ids.sort(-1), got_ids.sort(-1)
    assert torch.equal(order_w.values, order_g.values)
    torch.testing.assert_close(got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices))


def test_v3_variant_plain_q_no_interleave_yarn_ungrouped(tmp_path):
    """A second V3 geometry: plain q_proj, rope_interleave off, one expert group, no renormalisation, YaRN
    with mscale_all_dim only (rope attention factor and softmax scale both move); logits vs transformers."""
    import shutil

    from transformers import AutoModelForCausalLM

    from engine.models.embedded import embedded_model_dir

    cfg = hf_config("deepseek_v3", q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1,
                    norm_topk_prob=False, num_hidden_layers=2,
                    rope_parameters={"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0,
                                     "original_max_position_embeddings": 128, "mscale_all_dim": 1.0})
    cfg.initializer_range = 0.2
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / f, tmp_path / f)
    llm = LLM(_cfg(tmp_path))
    assert llm.runner.model_cfg.mla.softmax_scale != 48 ** -0.5 and not llm.runner.model_cfg.mla.rope_interleave
    ids = _prompt(77, 300)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (llm.prompt_logits(ids, chunk=64) - ref).abs().max().item() < 1e-3


def test_lora_on_the_mla_projections_matches_peft(family, tmp_path):
    """LoRA on MLA: an adapter on q_a/q_b (V3) or q_proj (V2), kv_a_proj_with_mqa and o_proj equals
    transformers + peft (teacher-forced logits within 1e-3, greedy tokens), a base request in the same batch
    keeps the base model's tokens; kv_b_proj (absorbed into the attention) and k_proj are refused by name."""
    from engine.extras.lora.adapter import write_random_adapter
    from tests.engine.test_lora import make_adapter

    kind, hf, _, cfg = family
    q = ["q_a_proj", "q_b_proj"] if kind == "deepseek_v3" else ["q_proj"]
    pm = make_adapter(hf, tmp_path / "a", 8, 16, [*q, "kv_a_proj_with_mqa", "o_proj"], False, seed=7)
    llm = LLM(replace(cfg, lora_paths=(f"a={tmp_path / 'a'}",), max_lora_rank=8))
    ids = _prompt(5, 40)
    with torch.no_grad():
        ref, base = (m(torch.tensor([ids])).logits[0].float() for m in (pm, hf))
    assert (ref - base).abs().max() > 0.1, "the adapter must move the logits"
    outs = llm.generate([ids, ids], GREEDY, loras=["a", ""])
    for model, out in zip((pm, hf), outs):
        seq = ids + out.output_ids
        with torch.no_grad():
            argmax = model(torch.tensor([seq[:-1]])).logits[0].argmax(-1).tolist()
        assert argmax[len(ids) - 1:] == out.output_ids, "greedy tokens differ from transformers (+ peft)"
    assert outs[0].output_ids != outs[1].output_ids
    assert llm.scheduler.kv.all_free()
    mc = ModelConfig.from_dir(cfg.model)
    for bad in ("kv_b_proj", "k_proj"):
        path = write_random_adapter(tmp_path / bad, mc, 4, ("o_proj",))
        raw = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps(raw | {"target_modules": ["o_proj", bad]}))
        with pytest.raises(ValueError, match=bad):
            LLM(replace(cfg, lora_paths=(f"b={path}",), max_lora_rank=8))
