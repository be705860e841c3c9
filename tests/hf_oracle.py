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


def hf_greedy_along(hf, ids: list[int], out: list[int], n: int, eos: set[int] | None = None) -> list[int]:  # noqa: ANN001
    """transformers' greedy continuation of `ids` (at most n tokens, ending after an id in `eos`), found
    by teacher forcing `out`, the continuation to check: one forward of ids + out instead of n decode
    steps. Returns the greedy tokens up to and including the first one that differs from `out` (or that
    `out` lacks), so the result equals `out` exactly when `out` is transformers' greedy continuation
    (what hf.generate(..., do_sample=False) returns: by induction, each token is the argmax after the
    prompt and the tokens before it), and otherwise shows where and how it diverged."""
    eos = eos or set()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out[:n]])).logits[0, len(ids) - 1:]
    choice = logits.argmax(-1).tolist()  # choice[k]: greedy token after ids + out[:k]
    ref: list[int] = []
    for k, tok in enumerate(choice):
        ref.append(tok)
        if k >= len(out) or tok != out[k] or tok in eos or len(ref) == n:
            break
    return ref
