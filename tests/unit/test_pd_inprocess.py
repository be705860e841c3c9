"""The PD lifecycle stepped in one process: a PrefillRole and a DecodeRole (real runners on a tiny
random-weight model, real zmq control plane, the fake data backend handing bytes over in-process)
must produce the colocated role's greedy tokens, and free every page on both sides."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.pd_harness import PDPair, colocated_tokens
from tests.tiny_model import make_tiny_model

PROMPTS = [[5, 17, 42, 99, 3, 7, 11], list(range(1, 40)), [200, 201, 202]]  # 1, several and one page(s)
SAMPLING = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_cfg(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    return EngineConfig(model=str(model), max_total_tokens=1024, host_kv_tokens=256, page_size=4,
                        chunked_prefill_size=16, max_prefill_tokens=32)


def test_pd_roles_in_process_match_colocated(engine_cfg: EngineConfig) -> None:
    want = colocated_tokens(engine_cfg, PROMPTS, SAMPLING)
    pair = PDPair(engine_cfg)
    try:
        d_tokens, d_done, p_done = pair.run(PROMPTS, SAMPLING)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
        assert pair.decode.stats()["transfer_rooms"] == {"succeeded": len(PROMPTS), "failed": 0}
    finally:
        pair.close()


def test_short_prompts_are_prefilled_on_the_decode(engine_cfg: EngineConfig) -> None:
    """Conditional disaggregation: prompts of at most the threshold are computed on the decode (the
    prefill ends their rooms without a forward, cleanly), longer ones go through PD; the tokens equal
    the colocated role's either way."""
    want = colocated_tokens(engine_cfg, PROMPTS, SAMPLING)
    threshold = 10  # PROMPTS[0] (7 tokens) and PROMPTS[2] (3) stay local; PROMPTS[1] (39) goes PD
    pair = PDPair(engine_cfg, local_threshold=threshold)
    try:
        d_tokens, d_done, p_done = pair.run(PROMPTS, SAMPLING)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert d_tokens == want
        assert all(not p_done[f"r{i}"].new_token_ids for i in (0, 2))  # the prefill sampled nothing
        counters = pair.decode.stats()["counters"]
        assert (counters["prefills_local"], counters["prefills_remote"]) == (2, 1)
        assert pair.prefill.stats()["counters"]["rooms_prefilled_on_decode"] == 2
        assert pair.prefill.stats()["counters"]["forward_tokens"] == len(PROMPTS[1])
        assert pair.decode.stats()["transfer_rooms"] == {"succeeded": 1, "failed": 0}
        assert pair.p_kv.all_free() and pair.d_kv.all_free()
        assert pair.p_mgr.active_rooms() == 0 and pair.d_mgr.active_rooms() == 0
    finally:
        pair.close()
