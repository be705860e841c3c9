"""Token logprobs and top-k alternatives from fp32 logits, for the output tokens (the sampler) and the
prompt tokens (the batch executor's extend rows).

A logprob is log_softmax of the model's raw logits (before any logit processor or temperature), as
transformers computes it. Top alternatives are `TopK = (ids, logprobs)`, best first. Nothing here
runs unless a request asked for logprobs: the hot path never computes a softmax over the vocabulary.
"""

from __future__ import annotations

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's chat limit; the most any request may ask for

TopK = tuple[list[int], list[float]]  # (token ids, their logprobs), best first


def token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> tuple[list[float], list[TopK]]:
    """logits: fp32 [n, V], targets: n token ids -> (logprob of each target [n], top-k of each row
    [n], empty when k == 0)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [n, V]
    idx = torch.tensor(targets, dtype=torch.long, device=lp.device).unsqueeze(1)  # [n, 1]
    chosen = lp.gather(1, idx).squeeze(1).tolist()
    if k <= 0:
        return chosen, []
    vals, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)  # [n, k] each
    return chosen, list(zip(ids.tolist(), vals.tolist()))
