"""Structured output (issue 16 part 5) on a tiny random-weight model with the embedded model's
tokenizer: whatever the weights, every output parses and validates against its schema (jsonschema)
or matches its regex, greedy and sampled, colocated and PD (the prefill samples token 1 under the
grammar, the decode's matcher accepts it first). Bad grammars raise GrammarError naming the
problem; compiled grammars are cached (LRU)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.forward.model_runner import ModelRunner
from engine.models.embedded import resolve_model_path
from engine.sampling.grammar import GrammarError, Grammars, GrammarSpec, load_hf_tokenizer, tokenizer_info
from engine.sampling.params import SamplingParams
from service import messages as m
from tests.pd_harness import PDPair, collect, colocated_tokens, kv_manager
from tests.tiny_model import make_tiny_model

EOS = 2
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b", "c"]}},
     "required": ["ok", "kind"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
                                      "n": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["tags", "n"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}}, "required": ["name"],
     "additionalProperties": False},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with the embedded model's vocabulary and tokenizer."""
    dst = make_tiny_model(tmp_path_factory.mktemp("tinytok"), vocab_size=49152, eos_token_id=EOS)
    src = resolve_model_path("embedded")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def cfg(model_dir: Path) -> EngineConfig:
    return EngineConfig(model=str(model_dir), max_total_tokens=2048, host_kv_tokens=256, page_size=4,
                        chunked_prefill_size=16, max_prefill_tokens=64)


@pytest.fixture(scope="module")
def tok(model_dir: Path):  # noqa: ANN201
    tokenizer_info(str(model_dir), 49152, (EOS,))  # built once per process; no role stalls on it
    return load_hf_tokenizer(str(model_dir))


PROMPTS = [[5, 17, 42, 99, 3, 7, 11], list(range(100, 130))]
MODES = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, seed=7)}


def colocated(cfg: EngineConfig, items: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    """One colocated role serving every (prompt, sampling) in one batch: the tokens of each."""
    runner = ModelRunner(cfg)
    kv = kv_manager(runner)
    role = ColocatedRole(cfg, runner, kv)
    tokens: dict[str, list[int]] = {}
    done: dict[str, m.TokenOut] = {}
    for i, (ids, sp) in enumerate(items):
        collect(role.add(m.GenerateReq(rid=f"r{i}", input_ids=ids, sampling=sp)), tokens, done)
    while len(done) < len(items):
        collect(role.step(), tokens, done)
    assert all(o.error is None and o.finish_reason == "stop" for o in done.values())
    assert kv.all_free()
    return [tokens[f"r{i}"] for i in range(len(items))]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_json_schema_outputs_validate_colocated_and_pd(cfg: EngineConfig, tok, mode: str) -> None:
    items = [(ids, SamplingParams(max_new_tokens=48, json_schema=json.dumps(schema), **MODES[mode]))
             for schema in SCHEMAS for ids in PROMPTS]
    outs = colocated(cfg, items)
    for (_, sp), ids in zip(items, outs):
        assert ids[-1] == EOS, tok.decode(ids)  # the grammar ended the request, not max_new_tokens
        jsonschema.validate(json.loads(tok.decode(ids, skip_special_tokens=True)), json.loads(sp.json_schema))
    pair = PDPair(cfg)
    try:
        got, d_done, _ = pair.run(PROMPTS, items[0][1])
    finally:
        pair.close()
    assert [got["r0"], got["r1"]] == outs[:2]  # the decode's matcher continued from the prefill's token 1
    assert {o.finish_reason for o in d_done.values()} == {"stop"}


def test_regex_and_ebnf_outputs_match(cfg: EngineConfig, tok) -> None:
    sp = SamplingParams(max_new_tokens=30, temperature=1.0, seed=3, regex=r"[0-9]{3}-[a-z]{2,4}")
    for ids in colocated_tokens(cfg, PROMPTS, sp).values():
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", tok.decode(ids, skip_special_tokens=True))
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ebnf='root ::= "yes" | "no"')
    for ids in colocated_tokens(cfg, PROMPTS, sp).values():
        assert tok.decode(ids, skip_special_tokens=True) in ("yes", "no")


def test_grammar_and_min_tokens_do_not_deadlock(cfg: EngineConfig, tok) -> None:
    """min_new_tokens bans EOS, which the finished grammar needs: the grammar wins."""
    sp = SamplingParams(max_new_tokens=20, temperature=0.0, min_new_tokens=10, regex="ab")
    for ids in colocated_tokens(cfg, PROMPTS, sp).values():
        assert tok.decode(ids, skip_special_tokens=True) == "ab"


def test_bad_grammars_name_the_problem_and_compiles_are_cached(model_dir: Path) -> None:
    g = Grammars(str(model_dir), 49152, [EOS], capacity=2)
    with pytest.raises(GrammarError, match=r"invalid json_schema: .*Unsupported type \"nope\""):
        g.compile(GrammarSpec("json_schema", '{"type": "nope"}'))
    with pytest.raises(GrammarError, match=r"invalid json_schema: .*syntax error"):
        g.compile(GrammarSpec("json_schema", "{not json"))
    with pytest.raises(GrammarError, match=r"invalid regex: .*Unclosed '\['"):
        g.compile(GrammarSpec("regex", "[a-"))
    with pytest.raises(GrammarError, match=r"invalid ebnf: .*Rule \"foo\" is not defined"):
        g.compile(GrammarSpec("ebnf", "root ::= foo"))
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    first = g.compile(a)
    assert g.compile(a) is first and g.compiles == 1
    g.compile(b), g.compile(c)  # capacity 2: a is evicted
    assert g.compiles == 3 and g.compile(a) is not first and g.compiles == 4


def test_sampling_params_take_one_grammar() -> None:
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    sp = SamplingParams.from_dict({"json_schema": {"type": "object"}})
    assert json.loads(sp.json_schema) == {"type": "object"} and sp.has_grammar


def test_matcher_continues_past_resumed_and_first_tokens(model_dir: Path, tok) -> None:  # noqa: ANN001
    """A migrated stream (the prompt's tail is earlier output) and a PD decode (token 1 from the
    prefill) build the matcher past those tokens: only the grammar's continuation can follow."""
    import torch

    from engine.request import Req
    from engine.sampling.sampler import Sampler

    sampler = Sampler(0, [EOS], Grammars(str(model_dir), 49152, (EOS,)))
    sp = SamplingParams(temperature=0.0, regex="(yes|no)-(red|blue)")
    done = tok.encode("yes-", add_special_tokens=False)
    rows = torch.zeros(2, 49152)
    rows[:, tok.encode("no", add_special_tokens=False)[0]] = 5.0  # the model would rather say "no"
    moved = Req("a", [7, 8, *done], sp, resumed_tokens=len(done))
    decode = Req("b", [7, 8, *done], sp, num_prompt_tokens=2)
    picked = sampler.sample(rows, [moved, decode])
    for t in picked:
        assert any(c.startswith(tok.decode([t])) for c in ("red", "blue")) and tok.decode([t])
