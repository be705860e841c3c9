"""Fixtures for engine tests on the embedded model: one runner and one HF oracle per session."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.models.embedded import embedded_model_dir

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
    from engine.model_runner import ModelRunner

    return ModelRunner(EngineConfig(max_total_tokens=16384, page_size=16, chunked_prefill_size=64))


@pytest.fixture(scope="session")
def hf_greedy(hf_model, prompts):
    """HF transformers' 32-token greedy continuation of each prompt, run alone."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=32, do_sample=False,
                                  pad_token_id=2)
            outs.append(y[0, len(ids):].tolist())
    return outs
