"""Sliding-window models (issue: Mistral-style models were silently wrong past the window).

Random-weight Mistral (window 64 on every layer) and Qwen2 (window on the upper layers only), saved
by transformers, run through the offline engine: teacher-forced logits within 1e-3 of transformers
for prompts of 10-600 tokens chunked at 32 and 128 over the paged cache, and greedy output identical.
Configs the engine cannot run exactly are refused at load, naming the field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.engine import LLM
from engine.kvcache.hicache import HiRadixCache
from engine.models.embedded import embedded_model_dir
from engine.sampling.params import SamplingParams
from tests.hf_oracle import hf_greedy

pytestmark = pytest.mark.slow

LENGTHS = [10, 63, 64, 65, 130, 300, 600]
SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
             bos_token_id=1, eos_token_id=2)


def _save(cfg, path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_model_dir() / name, path / name)
    return model


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def swa_model(request, tmp_path_factory):
    from transformers import MistralConfig, Qwen2Config

    path = tmp_path_factory.mktemp(request.param)
    if request.param == "mistral":
        hf = _save(MistralConfig(num_hidden_layers=2, sliding_window=64, **SMALL), path)
        windows = (64, 64)
    else:  # full attention on layer 0, window 48 on layers 1 and 2
        hf = _save(Qwen2Config(num_hidden_layers=3, use_sliding_window=True, sliding_window=48,
                               max_window_layers=1, **SMALL), path)
        windows = (0, 48, 48)
    return path, hf, windows


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(100, 49000, (n,), generator=g).tolist() for n in LENGTHS]


def test_config_reads_per_layer_windows(swa_model):
    path, _, windows = swa_model
    assert ModelConfig.from_dir(path).sliding_windows == windows


@pytest.mark.parametrize("chunk", [32, 128])
def test_teacher_forced_logits_match_transformers(swa_model, chunk):
    path, hf, _ = swa_model
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=4096, page_size=16, chunked_prefill_size=chunk))
    worst = 0.0
    for ids in _prompts():
        ours = llm.prompt_logits(ids, chunk=chunk)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (ours - ref).abs().max().item())
    assert worst < 1e-3, f"max abs logit diff {worst}"


def test_greedy_matches_transformers_alone_and_batched(swa_model):
    path, hf, _ = swa_model
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=8192, page_size=16, chunked_prefill_size=64))
    prompts = [p for p in _prompts() if len(p) in (10, 130, 600)]
    want = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=60, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            want.append(y[0, len(ids):].tolist())
    greedy = SamplingParams(temperature=0.0, max_new_tokens=60, ignore_eos=True)
    for ids, ref in zip(prompts, want):  # 60 new tokens: the 10-token prompt's decode crosses the window
        assert llm.generate([ids], greedy)[0].output_ids == ref
    assert [c.output_ids for c in llm.generate(prompts, greedy)] == want
    assert llm.scheduler.kv.all_free()


@pytest.mark.parametrize("change,field", [
    ({"layer_types": ["full_attention", "chunked_attention"]}, "layer_types"),
    ({"attention_chunk_size": 128}, "attention_chunk_size"),
    ({"sliding_window": -5}, "sliding_window"),
    ({"sliding_window": None, "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window"),
])
def test_configs_it_cannot_run_exactly_are_refused(tmp_path, change, field):
    cfg = {"model_type": "mistral", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64,
           "intermediate_size": 128, "vocab_size": 100, "sliding_window": 64} | change
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_dir(tmp_path)



def test_long_generation_holds_only_the_window_pages(swa_model):
    """Mistral (window on every layer) holds O(window) pages through a 600-token prompt and 120 new
    tokens; Qwen2 here has a full-attention layer, so it must keep every page."""
    from engine.request import Req

    path, hf, windows = swa_model
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=4096, page_size=16, chunked_prefill_size=64))
    ids = _prompts()[-1]  # 600 tokens
    req = Req(rid="long", token_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=120,
                                                                 ignore_eos=True))
    llm.scheduler.add(req)
    alloc, peak = llm.runner.pool.allocator, 0
    while llm.scheduler.has_work():
        llm.scheduler.step()
        peak = max(peak, alloc.num_used)
    if 0 in windows:
        assert llm.scheduler.kv.trimmed_pages == 0 and peak == (600 + 120 - 1 + 15) // 16
    else:  # window 64 + one 64-token chunk (+ the page a window straddles, + the page being filled)
        assert peak <= (64 + 64) // 16 + 2, peak
        assert llm.scheduler.kv.trimmed_pages >= (600 + 120 - 64) // 16 - 2
    assert req.output_ids == hf_greedy(hf, [ids], 120)[0]
    assert llm.scheduler.kv.all_free()


def test_full_attention_layers_keep_every_page(swa_model):
    path, _, windows = swa_model
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=4096, page_size=16, chunked_prefill_size=64))
    assert llm.scheduler.kv.window == (0 if 0 in windows else 64)


def test_retraction_with_freed_pages_reloads_exactly(swa_model):
    """Retract requests mid-generation (their KV to the host: for Mistral only the live pages, with
    holes where out-of-window pages were freed), reload them, and still match transformers."""
    from engine.request import Req

    path, hf, windows = swa_model
    llm = LLM(EngineConfig(model=str(path), max_total_tokens=4096, page_size=16, chunked_prefill_size=64,
                           host_kv_tokens=4096))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(100, 49000, (300,), generator=g).tolist() for _ in range(3)]
    sched = llm.scheduler
    reqs = [Req(rid=f"r{i}", token_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=40,
                                                                    ignore_eos=True))
            for i, ids in enumerate(prompts)]
    for r in reqs:
        sched.add(r)
    retracted = []
    while sched.has_work():
        sched.step()
        if not retracted and len(sched.running) == 3 and all(len(r.output_ids) >= 20 for r in sched.running):
            for r in list(sched.running[:2]):
                host_before = sched.kv.host.allocator.num_used
                live = len(r.kv.pages) - r.kv.dropped_pages
                sched.retract(r)
                assert sched.kv.host.allocator.num_used - host_before == live  # only live pages move
                retracted.append((r, r.kv.dropped_pages))
    assert len(retracted) == 2 and all(r.kv.retractions == 1 for r, _ in retracted)
    assert all(dropped > 0 for _, dropped in retracted) == (0 not in windows)
    assert [r.output_ids for r in reqs] == hf_greedy(hf, prompts, 40)
    assert sched.kv.all_free()


def test_the_host_tier_is_refused_where_no_layer_sees_everything(swa_model):
    """A windowed model runs without a prefix cache, so a host tier under it would do nothing: refused at
    start-up by name. With one full-attention layer (qwen2 here) the cache and its host tier run."""
    path, _, windows = swa_model
    cfg = EngineConfig(model=str(path), max_total_tokens=1024, page_size=16, prefix_cache=True,
                       hicache_host_tokens=256)
    if 0 in windows:
        assert isinstance(LLM(cfg).scheduler.kv.cache, HiRadixCache)
    else:
        with pytest.raises(ValueError, match="--hicache-host-tokens.*sliding window"):
            LLM(cfg)
