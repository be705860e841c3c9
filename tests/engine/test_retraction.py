"""Acceptance (engine core 3): a KV pool too small for all requests retracts to host and reloads."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLM
from engine.kvcache.kv_manager import KVManager
from engine.kvcache.memory import HostKVPool, KVPool
from engine.request import Req
from engine.sampling.params import SamplingParams

pytestmark = pytest.mark.slow


def test_offload_reload_restores_bytes():
    pool = KVPool(num_pages=17, num_layers=3, page_size=4, num_kv_heads=2, head_dim=8,
                  dtype=torch.float32, device="cpu")
    host = HostKVPool(16, tuple(pool.buffer.shape[1:]), torch.float32, pin=False)
    kv = KVManager(pool, host)
    r = Req(rid="a", token_ids=list(range(10)), sampling=SamplingParams())
    kv.grow(r, 10)
    pool.buffer.normal_()
    before = pool.buffer[r.kv.pages].clone()
    kv.offload(r)
    assert r.kv.pages == [] and len(r.kv.host_pages) == 3 and pool.allocator.num_used == 0
    pool.buffer.zero_()
    kv.reload(r)
    assert torch.equal(pool.buffer[r.kv.pages], before)
    kv.release(r)
    assert kv.all_free()


def test_small_pool_retracts_and_outputs_unchanged(runner, prompts):
    params = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    big = LLM(EngineConfig(max_total_tokens=16384, chunked_prefill_size=64), runner=runner)
    ref = big.generate(prompts, params)
    # a second runner with a pool of 960 tokens: all 8 prompts (872 tokens) + 384 outputs do not fit
    from engine.forward.model_runner import ModelRunner

    small_cfg = EngineConfig(max_total_tokens=960, host_kv_tokens=4096, chunked_prefill_size=64,
                             new_token_ratio=0.0)
    small = LLM(small_cfg, runner=ModelRunner(small_cfg))
    outs = small.generate(prompts, params)
    assert small.scheduler.kv.retractions > 0, "the pool was meant to be too small"
    assert small.scheduler.kv.reloads == small.scheduler.kv.retractions
    for a, b in zip(outs, ref):
        assert a.error is None
        assert a.output_ids == b.output_ids
    assert small.scheduler.kv.all_free()
