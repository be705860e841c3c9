"""Synthetic prompts have exact token counts; ShareGPT files parse or fail with a clear error."""

from __future__ import annotations

import json
import random

import pytest

from loadtest.workload import PromptMaker, SyntheticConfig, count_tokens, load_tokenizer, sharegpt, synthetic


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)  # the embedded model's tokenizer.json


def test_synthetic_prompts_have_exact_lengths(tok):
    specs = synthetic(SyntheticConfig(num_requests=20, input_len=100, output_len=8, input_len_std=40,
                                      output_len_std=3, seed=1), tok)
    assert len({s.prompt_len for s in specs}) > 5  # the lengths vary
    for s in specs:
        assert count_tokens(tok, s.prompt) == s.prompt_len
        assert 1 <= s.prompt_len <= 200 and 1 <= s.output_len <= 16
    again = synthetic(SyntheticConfig(num_requests=20, input_len=100, output_len=8, input_len_std=40,
                                      output_len_std=3, seed=1), tok)
    assert [s.prompt for s in again] == [s.prompt for s in specs]  # seeded


def test_fallback_from_random_ids_is_exact(tok):
    maker = PromptMaker(tok, random.Random(3))
    for n in (1, 7, 64):
        assert count_tokens(tok, maker._from_ids(n)) == n


def test_synthetic_config_validation():
    with pytest.raises(ValueError, match="num-requests"):
        SyntheticConfig(num_requests=0, input_len=1, output_len=1)
    with pytest.raises(ValueError, match="input-len"):
        SyntheticConfig(num_requests=1, input_len=0, output_len=1)


def test_sharegpt(tmp_path, tok):
    convs = [
        {"conversations": [{"from": "human", "value": "Tell me about the history of the bicycle please"},
                           {"from": "gpt", "value": "Bicycles appeared in nineteenth century Europe."}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello there friend"}]},
        {"conversations": [{"from": "gpt", "value": "no human turn"}]},
        {"id": "no conversations"},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    specs = sharegpt(path, tok, num_requests=10)
    assert len(specs) == 1  # the short and malformed ones are skipped
    assert specs[0].prompt.startswith("Tell me")
    assert specs[0].prompt_len == count_tokens(tok, specs[0].prompt)
    assert specs[0].output_len == count_tokens(tok, convs[0]["conversations"][1]["value"])
    assert sharegpt(path, tok, 10, output_len=33)[0].output_len == 33
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="dataset"):
        sharegpt(bad, tok, 1)
    bad.write_text(json.dumps({"a": 1}))
    with pytest.raises(ValueError, match="JSON list"):
        sharegpt(bad, tok, 1)
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
