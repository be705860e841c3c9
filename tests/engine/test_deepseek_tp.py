"""DeepSeek-V3 (MLA) under tensor parallelism: TP=2 (rank 0 here, rank 1 a real `spawn` process over gloo,
1 thread each) against transformers and TP=1. q/q_b and kv_b sharded by head, o_proj row-parallel, MoE
experts sharded along their intermediate; the latent replicated: every rank's pool holds the whole latent
[P, L, ps, kv_lora_rank + rope_dim]. The decode side of a TP > 1 PD pair receives one copy of each latent page
and broadcasts it to the other ranks (engine/distributed/tp_kv.py broadcast_latent): checked here by filling the TP=2
pool only through that path and decoding on.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.distributed import tp_kv
from engine.forward.forward_batch import LOGITS_ALL, LOGITS_LAST, Segment, forward_segments
from engine.kvcache.memory import pages_for
from tests.engine.test_deepseek import GREEDY, _prompt, save_deepseek
from tests.engine.test_tp import _serve
from tests.tp_spawn import tp_runner
from transfer.layout import page_view

ENGINE = dict(max_total_tokens=1024, host_kv_tokens=256, page_size=8, chunked_prefill_size=32,
              max_prefill_tokens=64, prefix_cache=True, threads=1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):  # noqa: ANN001, ANN201
    """(transformers model, TP=1 runner, TP=2 rank-0 runner) of one random DeepSeek-V3."""
    from engine.forward.model_runner import ModelRunner

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("deepseek_tp")
    hf = save_deepseek("deepseek_v3", path)
    one = ModelRunner(EngineConfig(model=str(path), **ENGINE))
    with tp_runner(EngineConfig(model=str(path), **ENGINE)) as two:
        yield hf, one, two


def _logits(runner, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    pages = runner.pool.allocator.allocate(pages_for(len(ids), runner.page_size))
    try:
        return torch.cat([forward_segments(runner, [Segment(pages, s, ids[s : s + 32], LOGITS_ALL)]).logits[0]
                          for s in range(0, len(ids), 32)])
    finally:
        runner.pool.allocator.free(pages)


@pytest.mark.slow
def test_tp2_shards_heads_and_replicates_the_latent(pair) -> None:  # noqa: ANN001
    hf, one, two = pair
    assert two.pool.buffer.shape == one.pool.buffer.shape  # the whole latent on every rank
    attn = two.model.layers[0].self_attn
    assert attn.hq == 2 and attn.kv_b.shape[0] == 2 * (32 + 24)
    worst = 0.0
    for n in (9, 70):
        ids = _prompt(n, n)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (_logits(two, ids) - ref).abs().max().item())
    assert worst < 1e-3, f"TP=2 vs transformers: max abs logit diff {worst}"
    print(f"TP=2 vs transformers: max abs logit diff {worst:.2e}")


@pytest.mark.slow
def test_tp2_greedy_batch_matches_tp1(pair) -> None:  # noqa: ANN001
    _, one, two = pair
    prompts = [_prompt(1, 12), _prompt(2, 45), _prompt(2, 45)[:30] + [4, 5]]
    ref, _, _ = _serve(one, prompts, GREEDY, one_by_one=True)
    got, done, _ = _serve(two, prompts, GREEDY, one_by_one=True)
    assert got == ref and all(len(t) == GREEDY.max_new_tokens for t in got.values())
    assert done["r2"].cached_tokens > 0, "the last prompt shares a cached prefix"


@pytest.mark.slow
def test_latent_pages_received_once_reach_every_rank(pair) -> None:  # noqa: ANN001
    """TP=1 computes a prompt's latent pages; they land in TP=2's pool only through tp_kv.scatter (rank 0
    holds the received bytes, rank 1 gets them by the broadcast); the next decode step's logits equal TP=1's."""
    _, one, two = pair
    ids = _prompt(7, 37)
    p1 = one.pool.allocator.allocate(pages_for(len(ids) + 1, one.page_size))
    p2 = two.pool.allocator.allocate(len(p1))
    try:
        forward_segments(one, [Segment(p1, 0, ids, LOGITS_LAST)])
        wire = page_view(one.pool.buffer)[torch.tensor(p1)].clone()  # uint8 [n, page_bytes]: what the wire moves
        tp_kv.scatter(two, p2, wire)
        want = forward_segments(one, [Segment(p1, len(ids), [11], LOGITS_LAST)]).logits[0]
        got = forward_segments(two, [Segment(p2, len(ids), [11], LOGITS_LAST)]).logits[0]
        assert (got - want).abs().max().item() < 1e-4
    finally:
        one.pool.allocator.free(p1)
        two.pool.allocator.free(p2)
