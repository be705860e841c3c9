"""Sliding-window models in PD (issue 20, part 3), stepped in one process (tests/pd_harness.py):
the prefill sends only the pages of the prompt's last window, the decode reserves only those, both
free pages that leave the window, greedy tokens equal the colocated role's (itself exact against
transformers: tests/engine/test_sliding_window.py), prompts longer than the whole KV pool are served,
and a pair that disagrees on the window fails at the handshake naming the field."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.kvcache.memory import pages_for
from engine.sampling.params import SamplingParams
from tests.pd_harness import PDPair, colocated_tokens
from tests.tiny_model import make_tiny_model

WINDOW, PAGE = 16, 4
POOL_TOKENS = 128  # 32 pages: the 300-token prompt fits only because out-of-window pages are freed
PROMPTS = [[(7 * i + n) % 250 + 1 for i in range(n)] for n in (10, 17, 40, 77, 300)]
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)


def _cfg(model, chunk: int) -> EngineConfig:
    return EngineConfig(model=str(model), max_total_tokens=POOL_TOKENS, host_kv_tokens=256, page_size=PAGE,
                        chunked_prefill_size=chunk, max_prefill_tokens=2 * chunk)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("swa")
    windowed = make_tiny_model(root / "mistral", model_type="mistral", sliding_window=WINDOW)
    full = make_tiny_model(root / "full", model_type="mistral", sliding_window=None)  # same weights
    return windowed, full


def _window_pages(n: int) -> int:
    """Pages of an n-token prompt that a query at position n (or later) can read."""
    return pages_for(n, PAGE) - max(0, n - WINDOW + 1) // PAGE


@pytest.mark.parametrize("chunk", [8, 16])
def test_pd_sends_and_holds_only_the_window(models, chunk: int) -> None:
    cfg = _cfg(models[0], chunk)
    want = colocated_tokens(cfg, PROMPTS, SAMPLING)
    pair = PDPair(cfg)
    try:
        tokens, d_done, p_done = pair.run(PROMPTS, SAMPLING)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert tokens == want
        page_bytes = pair.d_kv.pool.page_bytes
        sent = sum(_window_pages(len(p)) for p in PROMPTS) * page_bytes
        assert pair.decode.stats().transfer.bytes == sent
        assert pair.prefill.stats().transfer.bytes == sent
        assert sent < sum(pages_for(len(p), PAGE) for p in PROMPTS) * page_bytes / 2
        # the decode never holds more than each request's window plus the pages its tokens straddle
        bound = len(PROMPTS) * (pages_for(WINDOW + 1, PAGE) + 1)
        assert 0 < pair.d_kv.pool.allocator.high_water <= bound, bound
        assert pair.p_kv.trimmed_pages > 0 and pair.d_kv.trimmed_pages > 0
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
    finally:
        pair.close()


def test_window_mismatch_fails_at_the_handshake(models) -> None:
    pair = PDPair(_cfg(models[0], 16), decode_cfg=_cfg(models[1], 16))
    try:
        _, d_done, p_done = pair.run([PROMPTS[1]], SAMPLING)
        for out in (d_done["r0"], p_done["r0"]):
            assert out.error is not None and "'window'" in out.error, out.error
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
    finally:
        pair.close()


def test_prompt_longer_than_the_pool_is_refused_without_a_window(models) -> None:
    pair = PDPair(_cfg(models[1], 16))
    try:
        _, d_done, p_done = pair.run([PROMPTS[-1]], SAMPLING)
        for out in (d_done["r0"], p_done["r0"]):
            assert out.error is not None and "KV pool holds 128" in out.error, out.error
    finally:
        pair.close()
