"""PD for hybrid recurrent models between unequal prefill and decode TP (issue 48): the recurrent state
travels in the TP-independent layout (every part whole: service/pd.py StateWire,
engine/distributed/tp_state.py); a TP > 1 prefill gathers its ranks' rows into it, a TP > 1 decode
cuts each rank its rows out of it.

Without processes: each rank's state rows (StatePart.rows) are the channels and heads its weights are
(the conv weight's rows, A_log's heads), rank 0's model gives every rank's layout, and the ranks' rows
cover the whole state (a Mamba2 B/C group replicated at TP 4), so whole -> ranks -> whole is exact.
With a TP 2 group (rank 1 a spawned process over gloo, tests/tp_spawn.py): the in-process PD pair
prefill TP 2 -> decode TP 1 and TP 1 -> TP 2 gives the colocated tokens on one Gated DeltaNet family
(Qwen3-Next) and one Mamba2 family (Nemotron-H), every page and state slot freed on both sides.
The real router + prefill TP 2 + decode TP 1 stack is tests/engine/test_hybrid_serving.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig, ModelConfig
from engine.distributed.tp import TPGroup
from engine.forward.model_runner import ModelRunner
from engine.models.loader import load_model
from engine.recurrent.state_pool import check_cover, from_full, to_full
from engine.sampling.params import SamplingParams
from tests.hybrid_models import CONFIGS, VOCAB, write_hybrid
from tests.pd_harness import pd_equals_colocated
from tests.tp_spawn import tp_runner

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SIZES = {"qwen3_next": (2,), "nemotron_h": (2, 4)}  # Qwen3-Next has 2 key heads; Nemotron-H 2 groups of 8 heads


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def _cfg(path: str) -> EngineConfig:
    # no state snapshots: one runner serves either role (a decode keeps none: decode_engine_config)
    return EngineConfig(model=path, max_total_tokens=2048, host_kv_tokens=1024, page_size=16, chunked_prefill_size=64,
                        max_prefill_tokens=128, max_running_requests=8, state_cache_slots=0, threads=1)


@pytest.fixture(scope="module", params=list(CONFIGS))
def written(request, tmp_path_factory) -> tuple[str, Path]:  # noqa: ANN001
    torch.set_num_threads(1)
    dst = tmp_path_factory.mktemp(f"{request.param}_pd_tp")
    write_hybrid(request.param, dst)
    return request.param, dst


def _mixers(model) -> list:  # noqa: ANN001
    return [m for m in model.modules() if hasattr(m, "state_parts")]


def _take(t: torch.Tensor, runs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    return torch.cat([t[first : first + count] for first, count in runs])


def test_each_ranks_state_rows_are_its_weights_rows_and_cover_the_state(written):
    kind, path = written
    mc = ModelConfig.from_dir(path)
    whole = load_model(path, mc, "float32", "cpu", 256)
    full_spec = whole.state_spec()
    assert not full_spec.sliced and full_spec.full().describe() == full_spec.describe()
    assert full_spec.full().layout() == full_spec.layout()  # the TP 1 slot is the wire's layout, byte for byte
    g = torch.Generator().manual_seed(0)
    state = torch.randint(0, 256, (full_spec.layout()[1],), generator=g, dtype=torch.uint8)
    for size in SIZES[kind]:
        ranks = [load_model(path, mc, "float32", "cpu", 256, tp=TPGroup(rank=r, size=size)) for r in range(size)]
        specs = [m.state_spec() for m in ranks]
        assert all(s.sliced and s.full() == full_spec.full() for s in specs)
        assert [ranks[0].state_spec(TPGroup(rank=r, size=size)) for r in range(size)] == specs  # rank 0 knows all
        for model in ranks:
            for mine, one in zip(_mixers(model), _mixers(whole)):
                conv, ssm = mine.state_parts()
                assert torch.equal(mine.conv_weight, _take(one.conv_weight, conv.runs)), (kind, size, conv.name)
                assert torch.equal(mine.A_log, _take(one.A_log, ssm.runs)), (kind, size, ssm.name)
        check_cover(specs)
        back = torch.zeros_like(state)
        for spec in specs:
            to_full(spec, from_full(spec, state), back)
        assert torch.equal(back, state), (kind, size)
        with pytest.raises(ValueError, match="held by no rank"):
            check_cover(specs[:1])


@pytest.fixture(scope="module")
def runners(written):  # noqa: ANN001, ANN201
    """(cfg, TP 1 runner, TP 2 rank-0 runner) of the family; rank 1 a spawned process."""
    cfg = _cfg(str(written[1]))
    with tp_runner(cfg) as two:
        yield cfg, ModelRunner(cfg), two


PROMPTS = [_prompt(7, 21), _prompt(8, 150)]  # 150 tokens: three prompt chunks, gathered and sent chunk by chunk


@pytest.mark.slow
def test_pd_prefill_tp2_to_decode_tp1_equals_colocated(runners):
    cfg, one, two = runners
    pd_equals_colocated(cfg, PROMPTS, GREEDY, heartbeat_s=5.0, runners=(two, one))


@pytest.mark.slow
def test_pd_prefill_tp1_to_decode_tp2_equals_colocated(runners):
    cfg, one, two = runners
    pd_equals_colocated(cfg, PROMPTS, GREEDY, heartbeat_s=5.0, runners=(one, two))


@pytest.mark.slow
def test_the_wire_state_layout_is_the_same_at_any_tp(runners):
    """CompatInfo.state_layout names the whole layout: a TP 1 / TP 2 pair hashes alike (a pair whose layouts
    differ is refused with 412 by the transfer's compatibility check)."""
    from service.pd import StateWire, compat_info

    _, one, two = runners
    a, b = compat_info(one), compat_info(two)
    assert a.state_layout.startswith("whole:") and a.state_layout == b.state_layout
    assert a.digest() == b.digest() and (a.tp, b.tp) == (1, 2)
    assert StateWire(one).pages == StateWire(two).pages > 0
    assert "state_layout" in (b.mismatch({**a.to_dict(), "state_layout": a.state_layout + "x"}) or "")
