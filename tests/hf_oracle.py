"""The transformers side of the engine's oracle tests."""

from __future__ import annotations

import torch


def hf_greedy(hf, prompts: list[list[int]], n: int) -> list[list[int]]:  # noqa: ANN001
    """transformers' greedy continuation of each prompt: n new token ids, no EOS stop."""
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                            eos_token_id=None, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs
