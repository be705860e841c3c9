"""What only a GPU runs, for benchmarks/gpu_check.sh (skipped without CUDA; CI has none):

- the host tier's copy streams (engine/kvcache/hicache/host.py): pinned host pages, stores on the current
  stream, loads on the side stream that waits for queued work and makes the current stream wait for it;
  byte-exact round trips while the main stream is busy, and greedy conversations identical with the tier
  on and off on CUDA (with host hits);
- tensor parallelism over NCCL (engine/distributed/tp_ranks.py): TP 2 on two GPUs gives TP 1's logits
  (skipped, with the reason, on a machine with one GPU).

The families and every Triton kernel on CUDA are tests/engine/test_triton_models.py and tests/unit/triton/;
PD between two processes on one GPU is tests/integration/test_pd_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kvcache.memory import KVPool, pages_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (benchmarks/gpu_check.sh)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


def test_host_tier_copy_streams_roundtrip() -> None:
    from engine.kvcache.hicache.host import HostTier

    pool = KVPool(num_pages=64, num_layers=4, page_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                  device="cuda")
    tier = HostTier(pool, tokens=32 * 16)
    assert tier.stream is not None and tier.buffer.is_pinned()
    src, host, dst = list(range(1, 17)), list(range(16)), list(range(33, 49))
    for p in src:
        pool.buffer[p].fill_(float(p))
    want = pool.buffer[src].clone()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(4):  # queue work on the main stream: the store must be ordered after the fills
        big = big @ big / 64
    tier.store(src, host)
    pool.buffer[src].zero_()  # the freed pages' next writer, on the main stream after the store
    tier.load(host, dst)  # side stream: waits for the queued work; the main stream waits for it
    got = pool.buffer[dst]  # read on the main stream, no explicit synchronize
    assert torch.equal(got, want)
    assert tier.page_bytes_of(host[3]) == want[3].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    torch.cuda.synchronize()


def test_host_tier_on_cuda_keeps_greedy_outputs(tiny: str) -> None:
    from engine.forward.model_runner import ModelRunner
    from engine.request import Req
    from engine.sampling.params import SamplingParams
    from engine.scheduling.scheduler import Scheduler

    greedy = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    def conversations(host_tokens: int) -> tuple[list[list[int]], Scheduler]:
        cfg = EngineConfig(model=tiny, device="cuda", max_total_tokens=128, host_kv_tokens=256, page_size=4,
                           chunked_prefill_size=32, max_prefill_tokens=64, prefix_cache=True,
                           hicache_host_tokens=host_tokens)
        sched = Scheduler(ModelRunner(cfg), cfg)
        history = [[200 + c] + [(7 * c + i) % 190 + 1 for i in range(10)] for c in range(6)]
        outs = []
        for t in range(3):
            for c in range(6):  # round robin: the others evict a conversation's history before it returns
                prompt = history[c] + [(11 * c + 3 * t + i) % 190 + 1 for i in range(5)]
                r = Req(rid=f"c{c}t{t}", token_ids=list(prompt), sampling=greedy)
                sched.add(r)
                while not r.finished:
                    sched.step()
                    sched.drain()
                assert r.error is None, r.error
                outs.append(r.output_ids)
                history[c] = prompt + r.output_ids
        return outs, sched

    off, _ = conversations(0)
    on, sched = conversations(1024)
    assert on == off
    tiers = sched.kv.cache_stats().tiers
    assert tiers["hit_tokens"]["host"] > 0, "the pool was meant to evict histories to the host"
    sched.kv.flush()
    assert sched.kv.pool.allocator.all_free()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL TP needs two GPUs; this machine has one")
def test_tp2_over_nccl_matches_tp1(tiny: str) -> None:
    from engine.forward.forward_batch import LOGITS_ALL, Segment, forward_segments
    from engine.forward.model_runner import ModelRunner
    from tests.tp_spawn import tp_runner

    cfg = EngineConfig(model=tiny, device="cuda", max_total_tokens=256, page_size=4)
    ids = [(7 * i + 3) % 250 for i in range(37)]
    out = []
    with tp_runner(cfg) as two:
        for runner in (ModelRunner(cfg), two):
            pages = runner.pool.allocator.allocate(pages_for(len(ids), 4))
            rows = [forward_segments(runner, [Segment(pages, s, ids[s : s + 16], LOGITS_ALL)]).logits[0].cpu()
                    for s in range(0, len(ids), 16)]
            runner.pool.allocator.free(pages)
            out.append(torch.cat(rows))
    assert (out[0] - out[1]).abs().max().item() < 1e-4

