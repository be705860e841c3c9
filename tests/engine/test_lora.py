"""LoRA (issue 41): three random PEFT adapters of different ranks and targets on a tiny random Llama,
transformers+peft as the oracle: teacher-forced logits within 1e-3 for each adapter alone and for all
three plus the base in one forward; greedy tokens identical alone and batched; the slot registry
(LRU eviction of unused adapters, refusals naming the field); more adapters than --max-loras-per-batch
split into forwards; TP slicing of A/B equal to the whole adapter's update."""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLM
from engine.extras.lora.batch import Adapter
from engine.extras.lora.registry import LoRAError, LoRARegistry, parse_lora_paths
from engine.forward.forward_batch import LOGITS_ALL, Segment, forward_segments
from engine.kvcache.memory import pages_for
from engine.sampling.params import SamplingParams
from tests.hf_oracle import hf_greedy

pytestmark = pytest.mark.slow

SMALL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, num_hidden_layers=2,
             tie_word_embeddings=False)
# name -> (rank, alpha, targets, rslora)
ADAPTERS = {"qv4": (4, 8, ["q_proj", "v_proj"], False),
            "all8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
            "mlp16": (16, 8, ["o_proj", "gate_proj", "down_proj", "k_proj"], True)}
LENGTHS = [5, 40, 97]


def make_adapter(base, dst, rank: int, alpha: int, targets: list[str], rslora: bool, seed: int):  # noqa: ANN001, ANN201
    """A random (B != 0) PEFT LoRA adapter on a copy of `base`, saved to `dst`; returns the peft model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                     use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(copy.deepcopy(base), cfg).eval()
    model.save_pretrained(str(dst))
    return model


@pytest.fixture(scope="module")
def lora_setup(hf_checkpoint, tmp_path_factory):
    from transformers import LlamaConfig

    path, hf = hf_checkpoint(LlamaConfig(**SMALL), "lora-base")
    root = tmp_path_factory.mktemp("adapters")
    peft_models, paths = {}, {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        paths[name] = root / name
        peft_models[name] = make_adapter(hf, paths[name], *spec, seed=10 + i)
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=8192, page_size=16, chunked_prefill_size=64,
                           threads=1, max_loaded_loras=4, max_lora_rank=16,
                           lora_paths=tuple(f"{n}={p}" for n, p in paths.items())))
    return hf, peft_models, paths, llm


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, SMALL["vocab_size"], (n,), generator=g).tolist() for n in LENGTHS]


def _logits(llm: LLM, batch: list[tuple[list[int], str]]) -> list[torch.Tensor]:
    """Teacher-forced logits of each (prompt, adapter) in ONE forward."""
    alloc = llm.runner.pool.allocator
    pages = [alloc.allocate(pages_for(len(ids), 16)) for ids, _ in batch]
    try:
        return forward_segments(llm.runner, [Segment(p, 0, ids, LOGITS_ALL, 0, _adapter(name))
                                             for p, (ids, name) in zip(pages, batch)]).logits
    finally:
        for p in pages:
            alloc.free(p)


def _adapter(name: str) -> tuple[Adapter, ...]:
    """A segment's extras for adapter `name` ("" = the base model: none)."""
    return (Adapter(name),) if name else ()


def _ref(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_each_adapter_alone_matches_peft(lora_setup):
    hf, peft_models, _, llm = lora_setup
    worst = {}
    for name, pm in peft_models.items():
        for ids in _prompts():
            ours = _logits(llm, [(ids, name)])[0]
            ref = _ref(pm, ids)
            assert (ref - _ref(hf, ids)).abs().max() > 0.1, f"{name}: the adapter must move the logits"
            worst[name] = max(worst.get(name, 0.0), (ours - ref).abs().max().item())
    print("max abs logit diff per adapter:", worst)
    assert max(worst.values()) < 1e-3, worst


def test_three_adapters_and_base_in_one_batch(lora_setup):
    hf, peft_models, _, llm = lora_setup
    ids = _prompts()
    batch = [(ids[0], "mlp16"), (ids[1], ""), (ids[2], "qv4"), (ids[1], "all8"), (ids[0], "")]
    outs = _logits(llm, batch)
    for (p, name), ours in zip(batch, outs):
        ref = _ref(peft_models[name] if name else hf, p)
        assert (ours - ref).abs().max().item() < 1e-3, f"{name or 'base'} in the mixed batch"


def test_greedy_identical_alone_and_batched(lora_setup):
    hf, peft_models, _, llm = lora_setup
    prompts = _prompts()
    sp = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    names = ["", "qv4", "all8", "mlp16"]
    refs = {n: hf_greedy(peft_models[n] if n else hf, prompts[:2], 12) for n in names}
    batch_prompts = [p for p in prompts[:2] for _ in names]
    batch_names = [n for _ in prompts[:2] for n in names]
    together = llm.generate(batch_prompts, sp, loras=batch_names)
    for i, (p, n, out) in enumerate(zip(batch_prompts, batch_names, together)):
        assert out.output_ids == refs[n][i // len(names)], f"{n or 'base'} batched diverged from peft"
        alone = llm.generate([p], sp, loras=[n])[0]
        assert alone.output_ids == out.output_ids
    assert llm.scheduler.kv.all_free()


def test_more_adapters_than_per_batch_cap_split_forwards(lora_setup):
    hf, peft_models, _, llm = lora_setup
    ids = _prompts()[1]
    cfg = llm.runner.cfg
    llm.runner.cfg = dataclasses.replace(cfg, max_loras_per_batch=1)  # three adapters -> three forwards
    try:
        outs = _logits(llm, [(ids, "qv4"), (ids, "all8"), (ids, ""), (ids, "mlp16")])
    finally:
        llm.runner.cfg = cfg
    for name, ours in zip(["qv4", "all8", "", "mlp16"], outs):
        assert (ours - _ref(peft_models[name] if name else hf, ids)).abs().max().item() < 1e-3


def test_registry_lru_evicts_unused_and_refuses(lora_setup):
    _, _, paths, llm = lora_setup
    reg = LoRARegistry(llm.runner.model_cfg, slots=2, max_rank=16)
    assert reg.load("a", str(paths["qv4"])) is None and reg.load("b", str(paths["all8"])) is None
    reg.batch(["a"], [1])  # a is now the most recently used
    assert reg.load("c", str(paths["mlp16"])) == "b" and reg.names() == ["a", "c"]
    with pytest.raises(LoRAError) as e:
        reg.load("d", str(paths["qv4"]), busy={"a", "c"})
    assert e.value.code == 409 and "--max-loaded-loras" in str(e.value)
    with pytest.raises(LoRAError, match="already loaded"):
        reg.load("a", str(paths["all8"]))
    with pytest.raises(LoRAError, match="max-lora-rank"):
        LoRARegistry(llm.runner.model_cfg, 2, max_rank=8).load("big", str(paths["mlp16"]))
    with pytest.raises(LoRAError) as e:
        reg.unload("zzz")
    assert e.value.code == 404
    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora_paths(["nopath"])


def test_refused_adapter_fields(lora_setup, tmp_path):
    _, _, paths, llm = lora_setup
    reg = LoRARegistry(llm.runner.model_cfg, 2, 16)
    raw = json.loads((paths["qv4"] / "adapter_config.json").read_text())
    for field, value in [("use_dora", True), ("target_modules", ["embed_tokens"])]:
        (tmp_path / "adapter_config.json").write_text(json.dumps(raw | {field: value}))
        with pytest.raises(LoRAError, match=field):
            reg.load("x", str(tmp_path))


def test_tp_slices_sum_to_the_whole_update(lora_setup):
    """Two ranks' A/B shares (column-parallel rows of B, row-parallel columns of A) give the whole update."""
    from engine.distributed.tp import TPGroup
    from engine.extras.lora.adapter import load_adapter

    _, _, paths, llm = lora_setup
    mc = llm.runner.model_cfg
    whole = load_adapter("w", paths["all8"], mc, 16)
    parts = [load_adapter("w", paths["all8"], mc, 16, TPGroup(r, 2)) for r in range(2)]
    x = torch.randn(3, 64)
    a, b = whole.weights[1]["qkv"]
    ref = (x @ a.T) @ b.T  # [3, (4 + 2 + 2) * 16]
    d = mc.head_dim
    got = [(x @ p.weights[1]["qkv"][0].T) @ p.weights[1]["qkv"][1].T for p in parts]
    q = torch.cat([g[:, : 2 * d] for g in got], 1)
    k = torch.cat([g[:, 2 * d : 3 * d] for g in got], 1)
    v = torch.cat([g[:, 3 * d :] for g in got], 1)
    assert torch.allclose(torch.cat([q, k, v], 1), ref, atol=1e-5)
    a, b = whole.weights[0]["down"]
    h = torch.randn(3, 128)
    halves = [(h[:, r * 64 : (r + 1) * 64] @ p.weights[0]["down"][0].T) @ p.weights[0]["down"][1].T
              for r, p in enumerate(parts)]
    assert torch.allclose(halves[0] + halves[1], (h @ a.T) @ b.T, atol=1e-5)


def test_tp2_with_adapters_matches_tp1(tmp_path):
    """TP 2 (rank 1 a spawned process over gloo): adapters loaded at start-up and at run time (a rank
    op on both ranks) give the TP 1 logits, each rank holding its A/B shares."""
    from engine.config import ModelConfig
    from engine.distributed import tp_ranks
    from engine.distributed.tp_runner import make_runner
    from engine.extras.lora import runner as lora_runner
    from engine.extras.lora.adapter import write_random_adapter
    from engine.forward.model_runner import ModelRunner
    from tests.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "m")
    mc = ModelConfig.from_dir(model)
    a = write_random_adapter(tmp_path / "a", mc, 4, ("q_proj", "v_proj", "down_proj"), seed=1, std=0.3)
    b = write_random_adapter(tmp_path / "b", mc, 8, seed=2, std=0.3)
    eng = dict(model=str(model), max_total_tokens=512, page_size=4, threads=1, max_loaded_loras=2, max_lora_rank=8,
               lora_paths=(f"a={a}",))
    one = ModelRunner(EngineConfig(**eng))
    cfg, _store = tp_ranks.host_rendezvous(EngineConfig(tp=2, **eng))
    procs = tp_ranks.spawn_ranks(cfg)
    try:
        two = make_runner(cfg)
        for r in (one, two):
            lora_runner.load(r, "b", str(b))
        ids = [(5 * i + 3) % 250 for i in range(19)]
        batch = [("a", ids), ("", ids[:7]), ("b", ids[:11])]
        outs = []
        for r in (one, two):
            pages = [r.pool.allocator.allocate(pages_for(len(x), 4)) for _, x in batch]
            outs.append(forward_segments(r, [Segment(p, 0, x, LOGITS_ALL, 0, _adapter(n))
                                             for p, (n, x) in zip(pages, batch)]).logits)
        for (name, _), x1, x2 in zip(batch, *outs):
            assert (x1 - x2).abs().max().item() < 1e-4, name
        assert (outs[0][0][:7] - outs[0][1]).abs().max() > 1e-2  # the adapter changes the logits
        two.close()
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
