"""Fixtures for engine tests on the embedded model: one runner and one HF oracle per session."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.models.embedded import embedded_model_dir
from tests.hf_oracle import hf_greedy_along

TEXTS = [
    "Hello!",
    "What is the capital of France?",
    "Write a short poem about the ocean and the moon.",
    "Explain in simple words how a transformer language model predicts the next token.",
    "List three fruits.",
]


def make_prompts(tokenizer) -> list[list[int]]:  # noqa: ANN001
    """8 prompts of 5 to 300 tokens (real text, repeated to length)."""
    story = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps "
             "and listening to the waves below. ") * 20
    lengths = [5, 12, 33, 64, 97, 150, 211, 300]
    prompts = []
    for i, n in enumerate(lengths):
        ids = tokenizer.encode(TEXTS[i % len(TEXTS)] + " " + story)
        prompts.append(ids[:n])
    return prompts


@pytest.fixture(scope="session")
def model_dir():
    return embedded_model_dir()


@pytest.fixture(scope="session")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="session")
def prompts(tokenizer):
    return make_prompts(tokenizer)


@pytest.fixture(scope="session")
def runner():
    from engine.forward.model_runner import ModelRunner

    return ModelRunner(EngineConfig(max_total_tokens=16384, page_size=16, chunked_prefill_size=64))


@pytest.fixture(scope="session")
def hf_greedy(hf_model):
    """hf_greedy(ids, out, n): transformers' greedy continuation of `ids` (n tokens, or up to its EOS)
    checked against `out` by teacher forcing (tests/hf_oracle.py, hf_greedy_along): equals `out` exactly
    when `out` is what hf_model.generate(do_sample=False) returns. One forward per check, memoized."""
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos}
    memo: dict = {}

    def check(ids: list[int], out: list[int], n: int) -> list[int]:
        key = (tuple(ids), tuple(out), n)
        if key not in memo:
            memo[key] = hf_greedy_along(hf_model, ids, out, n, eos)
        return memo[key]

    return check


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """Factory: hf_checkpoint(config, name, init_std=0.2) -> (directory, model). A random-weight
    transformers model of `config` (one of transformers' config classes), weights drawn with std
    `init_std` (large enough that a wrong layer moves the logits well past 1e-3) and RMSNorm weights
    in [0.5, 1.5], saved fp32 with the embedded model's tokenizer files (the offline LLM loads a
    tokenizer); the model, in eval mode, is the oracle."""
    import shutil

    from transformers import AutoModelForCausalLM

    def make(config, name: str, init_std: float = 0.2):  # noqa: ANN001, ANN202
        path = tmp_path_factory.mktemp(name)
        config.initializer_range = init_std
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
        with torch.no_grad():  # norms start at ones: move them, so a norm loaded wrong (or not at all) shows
            for n, p in model.named_parameters():
                if n.endswith("norm.weight"):
                    p.uniform_(0.5, 1.5)
        model.save_pretrained(path)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(embedded_model_dir() / f, path / f)
        return path, model

    return make
