"""Logit processors and position-keyed seeded sampling (issue 16, parts 2 and 4).

Repetition penalty is checked against transformers' RepetitionPenaltyLogitsProcessor; frequency and
presence penalties against OpenAI's formula written out; min_new_tokens and logit_bias by their
effect on the choice. Seeded draws depend on (seed, output position) only, so PD (first token on the
prefill, the rest on the decode) gives the colocated text, with processors too."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from engine.config import EngineConfig
from engine.sampling.params import SamplingParams
from engine.sampling.sampler import Sampler, process_logits
from tests.pd_harness import PDPair, colocated_tokens
from tests.tiny_model import make_tiny_model

V = 50
EOS = 49


@dataclass
class R:
    rid: str
    input_ids: list[int]
    output_ids: list[int]
    sampling: SamplingParams
    resumed_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:  # engine.request.Req keeps one list: prompt then output
        return self.input_ids + self.output_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3


def test_repetition_penalty_matches_transformers() -> None:
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    row = _logits()
    r = R("a", [1, 2, 3, 3, 10], [10, 20, 7], SamplingParams(repetition_penalty=1.3))
    ours = process_logits(row, r, [EOS])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([r.input_ids + r.output_ids]), row.clone()[None])[0]
    torch.testing.assert_close(ours, ref)


def test_frequency_and_presence_penalties_follow_openai() -> None:
    row = _logits(1)
    r = R("a", [4, 5], [7, 7, 7, 9], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25))
    want = row.clone()
    want[7] -= 3 * 0.5 + 0.25
    want[9] -= 1 * 0.5 + 0.25  # prompt tokens 4 and 5 are not penalised
    torch.testing.assert_close(process_logits(row, r, [EOS]), want)


def test_min_new_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    row = torch.zeros(V)
    row[EOS], row[11] = 10.0, 9.0
    sp = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=(11,))
    s = Sampler(0, [EOS])
    before = R("a", [1], [3], sp)  # one token generated: EOS and 11 still banned
    after = R("a", [1], [3, 4], sp)
    assert s.sample(row[None], [before])[0] not in (EOS, 11)
    assert s.sample(row[None], [after])[0] == EOS


def test_logit_bias_moves_greedy_and_sampled_choices() -> None:
    row = _logits(2)
    target = int(torch.argmin(row))
    for temp in (0.0, 0.7):
        sp = SamplingParams(temperature=temp, seed=3, logit_bias=((target, 100.0),))
        assert Sampler().sample(row[None], [R("a", [1], [], sp)]) == [target]


def test_seeded_draws_depend_on_seed_and_position_only() -> None:
    flat = torch.zeros(1000)
    sp = SamplingParams(temperature=1.0, seed=42)
    s = Sampler(default_seed=7)
    draws = [s.sample(flat[None], [R("x", [1], [0] * k, sp)])[0] for k in range(8)]
    # the same position gives the same token whatever the rid, the batch or the engine's default seed
    other = Sampler(default_seed=99)
    batch = [R("y", [5, 6], [1] * 3, sp), R("z", [2], [], SamplingParams(temperature=1.0, seed=5))]
    assert other.sample(flat.expand(2, -1), batch)[0] == draws[3]
    assert len(set(draws)) > 4  # positions are not all the same draw


def test_a_migrated_request_samples_as_if_it_had_not_moved() -> None:
    """After a migration the tokens streamed so far are the tail of the new prompt (resumed_tokens):
    seeded positions and penalties still count them as output, so the next draw is the same."""
    row = _logits(4)
    sp = SamplingParams(temperature=1.0, seed=11, frequency_penalty=0.9, presence_penalty=0.4)
    prompt, streamed = [1, 2, 3], [7, 7, 9]
    original = R("a", prompt, list(streamed), sp)
    moved = R("b", prompt + streamed, [], sp, resumed_tokens=len(streamed))
    torch.testing.assert_close(process_logits(row, moved, [EOS]), process_logits(row, original, [EOS]))
    draws = {Sampler(d).sample(row[None], [r])[0] for d in (0, 5) for r in (original, moved)}
    assert len(draws) == 1


@pytest.fixture(scope="module")
def engine_cfg(tmp_path_factory: pytest.TempPathFactory) -> EngineConfig:
    model = make_tiny_model(tmp_path_factory.mktemp("tiny"))
    return EngineConfig(model=str(model), max_total_tokens=1024, host_kv_tokens=256, page_size=4,
                        chunked_prefill_size=16, max_prefill_tokens=32)


@pytest.mark.parametrize("sp", [
    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_new_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=99, max_new_tokens=12, frequency_penalty=0.7, presence_penalty=0.3,
                   repetition_penalty=1.3, logit_bias=((17, 3.0), (42, -100.0)), min_new_tokens=12),
], ids=["seeded", "seeded+processors"])
def test_seeded_sampling_is_the_same_text_in_pd_and_colocated(engine_cfg: EngineConfig, sp) -> None:
    prompts = [[5, 17, 42, 99, 3, 7, 11], list(range(1, 40))]
    want = colocated_tokens(engine_cfg, prompts, sp)
    assert want["r0"] != want["r1"]
    pair = PDPair(engine_cfg)
    try:
        got, d_done, p_done = pair.run(prompts, sp)
        assert all(o.error is None for o in [*p_done.values(), *d_done.values()])
        assert got == want
        if sp.logit_bias:
            assert 42 not in got["r0"] + got["r1"]
    finally:
        pair.close()
