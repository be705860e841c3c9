"""Issue 40 (engine.extras.features) against transformers on a tiny random Llama, colocated and in PD
(in-process pair): `return_hidden_states` equals transformers' `output_hidden_states[-1]` (the last
layer after the final norm) at every prompt position and every decode step; `input_embeds` (the
model's own embeddings of the ids) gives the ids' tokens and hidden states, random embeddings equal
transformers' `inputs_embeds` forward; `token_ids_logprob` equals log_softmax at the chosen ids."""

from __future__ import annotations

import pytest
import torch

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.forward.model_runner import ModelRunner
from engine.sampling.params import SamplingParams
from service import messages as m
from tests.pd_harness import PDPair, collect, generate_req, kv_manager
from tests.tiny_model import make_tiny_model

PROMPT = [5, 17, 42, 99, 3, 7, 11, 200, 1, 2, 3, 4, 9, 8, 7, 6, 5, 4, 30, 31, 32]  # > one 16-token chunk
SP = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
IDS = [3, 7, 250]
TOL = 1e-3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def cfg(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_total_tokens=1024, host_kv_tokens=256, page_size=4,
                        chunked_prefill_size=16, max_prefill_tokens=32, prefix_cache=True)


@pytest.fixture(scope="module")
def hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def role(cfg):
    runner = ModelRunner(cfg)
    return ColocatedRole(cfg, runner, kv_manager(runner, True))


def _serve(role: ColocatedRole, rid: str, ids: list[int], **fields) -> list[m.TokenOut]:
    outs: list[m.TokenOut] = []
    done: dict[str, m.TokenOut] = {}
    collect(role.add(generate_req(rid, ids, SP, **fields)), {}, done, outs)
    while rid not in done:
        collect(role.step(), {}, done, outs)
    assert done[rid].error is None, done[rid].error
    return outs


def _joined(outs: list[m.TokenOut]) -> dict:
    got: dict = {"ids": [], "hp": [], "ho": [], "io": [], "ii": []}
    for o in outs:
        got["ids"] += o.new_token_ids
        if o.hidden_prompt:
            assert not got["hp"], "prompt hidden states reported twice"
            got["hp"] = o.hidden_prompt
        got["ho"] += o.hidden_output
        got["io"] += o.ids_output
        got["ii"] += o.ids_input
    return got


def _hf_hidden(hf, ids: list[int] | None = None, embeds: torch.Tensor | None = None):
    with torch.no_grad():
        out = hf(input_ids=None if ids is None else torch.tensor([ids]),
                 inputs_embeds=None if embeds is None else embeds[None], output_hidden_states=True)
    return out.hidden_states[-1][0].float(), torch.log_softmax(out.logits[0].float(), dim=-1)


def _check_hidden(got: dict, ref: torch.Tensor, n_prompt: int) -> float:
    """Prompt rows 0..T-1, then one row per decode step (positions T..T+N-2)."""
    assert len(got["hp"]) == n_prompt and len(got["ho"]) == len(got["ids"]) - 1
    ours = torch.tensor(got["hp"] + got["ho"])
    return (ours - ref[: ours.shape[0]]).abs().max().item()


def test_hidden_states_match_transformers(role, hf) -> None:
    got = _joined(_serve(role, "h0", PROMPT, return_hidden_states=True))
    ref, _ = _hf_hidden(hf, PROMPT + got["ids"])
    diff = _check_hidden(got, ref, len(PROMPT))
    print(f"max |hidden - transformers| colocated: {diff:.2e}")
    assert diff < TOL
    again = _joined(_serve(role, "h1", PROMPT, return_hidden_states=True))  # the prompt is cached now
    assert len(again["hp"]) == len(PROMPT) and again["ids"] == got["ids"]  # every position still computed
    plain = _joined(_serve(role, "h2", PROMPT))
    assert plain["ids"] == got["ids"] and not plain["hp"] and not plain["ho"]


def test_token_ids_logprob_match_transformers(role, hf) -> None:
    got = _joined(_serve(role, "t0", PROMPT, return_logprob=True, logprob_start_len=0, token_ids_logprob=IDS))
    _, lp = _hf_hidden(hf, PROMPT + got["ids"])
    n = len(PROMPT)
    assert len(got["io"]) == len(got["ids"]) and len(got["ii"]) == n - 1
    ref_out = lp[n - 1 : n - 1 + len(got["ids"])][:, IDS]
    ref_in = lp[: n - 1][:, IDS]
    assert (torch.tensor(got["io"]) - ref_out).abs().max().item() < TOL
    assert (torch.tensor(got["ii"]) - ref_in).abs().max().item() < TOL


def test_input_embeds_equal_ids_and_transformers(role, hf) -> None:
    table = hf.get_input_embeddings().weight.detach().float()
    same = table[PROMPT].contiguous()
    base = _joined(_serve(role, "e0", PROMPT, return_hidden_states=True))
    via = _joined(_serve(role, "e1", [0] * len(PROMPT), input_embeds=same.numpy().tobytes(),
                         return_hidden_states=True))
    assert via["ids"] == base["ids"]
    assert (torch.tensor(via["hp"]) - torch.tensor(base["hp"])).abs().max().item() < TOL
    g = torch.Generator().manual_seed(3)
    rand = torch.randn(len(PROMPT), table.shape[1], generator=g) * 0.2
    got = _joined(_serve(role, "e2", [0] * len(PROMPT), input_embeds=rand.numpy().tobytes(),
                         return_hidden_states=True))
    ref, lp = _hf_hidden(hf, embeds=rand)
    assert got["ids"][0] == int(lp[-1].argmax())
    assert (torch.tensor(got["hp"]) - ref).abs().max().item() < TOL
    # placeholder ids never share pages: the same placeholders with other embeddings differ
    other = _joined(_serve(role, "e3", [0] * len(PROMPT), input_embeds=same.numpy().tobytes(),
                           return_hidden_states=True))
    assert other["ids"] == base["ids"]
    assert role.kv.cache is not None


def test_pd_carries_prompt_states_and_ids_logprobs(cfg, hf) -> None:
    pair = PDPair(cfg)
    try:
        seen: list[m.TokenOut] = []
        _, d_done, p_done = pair.run([PROMPT], SP, seen=seen, fields={
            "return_hidden_states": True, "return_logprob": True, "logprob_start_len": 0,
            "token_ids_logprob": IDS})
        assert d_done["r0"].error is None and p_done["r0"].error is None
        assert not p_done["r0"].hidden_prompt  # the prefill's go to the decode with the KV
        got = _joined(seen)
        ref, lp = _hf_hidden(hf, PROMPT + got["ids"])
        assert _check_hidden(got, ref, len(PROMPT)) < TOL
        n = len(PROMPT)
        assert len(got["io"]) == len(got["ids"]) and len(got["ii"]) == n - 1
        assert (torch.tensor(got["io"]) - lp[n - 1 : n - 1 + len(got["ids"])][:, IDS]).abs().max().item() < TOL
        assert (torch.tensor(got["ii"]) - lp[: n - 1][:, IDS]).abs().max().item() < TOL
        embeds = hf.get_input_embeddings().weight.detach().float()[PROMPT].contiguous()
        tokens, d_done, _ = pair.run([[0] * n], SP, fields={"input_embeds": embeds.numpy().tobytes()},
                                     room_base=200)
        assert d_done["r0"].error is None and tokens["r0"] == got["ids"]
    finally:
        pair.close()


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_pooling_match_transformers(role, hf, pooling: str) -> None:
    """service/embeddings.py's worker side: chunked over pages freed at once, pooled, normalised."""
    from service.embeddings import handle_worker

    free = role.kv.free_pages
    out = handle_worker(role, m.EmbedReq(token=1, inputs=[PROMPT, PROMPT[:3]], pooling=pooling, dimensions=8), 16)
    assert out.error == "" and len(out.data) == 2 and role.kv.free_pages == free
    for got, ids in zip(out.data, (PROMPT, PROMPT[:3])):
        h = _hf_hidden(hf, ids)[0]
        v = h[-1] if pooling == "last" else h.mean(dim=0)
        want = torch.nn.functional.normalize(v[:8], dim=0)
        assert (torch.tensor(got) - want).abs().max().item() < TOL
