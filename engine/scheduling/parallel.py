"""Parallel sampling (`n` > 1): one prompt, n choices, the prompt computed once.

The request as received is choice 0 (the parent); `add_choices` hangs choices 1..n-1 on it
(`parent.choice.forks`). They wait there, holding nothing, until the parent's prompt is computed; then:
1. The forward's last-position logits of the parent are sampled once per choice, each with its own
   sampling seed (`choice_seed`), so every choice's first token comes from the same exact logits
   (engine.forward.batch: `BatchExecutor` samples the forks from the parent's row). In PD the prefill does
   this and sends the n first tokens; the decode receives them (decode_service/worker.py).
2. Each choice forks the parent's KV (`KVManager.fork`): the full prompt pages are shared (the
   prefix cache's tree, or a private one when the cache is off; locked by every choice), and only the
   partial last page is copied, since each choice writes its own tokens into it. Sliding-window
   models copy the live pages instead (trimming would free pages another choice still reads).
3. The choices run as ordinary requests; each finishes and frees its own pages on its own; the
   shared pages go when the last lock drops.

Seeds: choice i of a request with seed s draws from `choice_seed(s, i)` (s itself for choice 0, so
choice 0 equals the n=1 answer), a function of (s, i) alone: reproducible, and the same colocated or
in PD. Unseeded choices draw from their own rid (`choice_rid`), as any unseeded request does.
"""

from __future__ import annotations

import dataclasses

from engine.request import Choice, LogprobState, Req
from engine.request_groups import LogprobParams

MAX_N = 64  # choices per request (service.protocol refuses more with a 400)
_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio
_MASK = (1 << 63) - 1  # seeds are in 0 .. 2^63-1


def choice_seed(seed: int | None, index: int) -> int | None:
    """The sampling seed of choice `index` of a request seeded `seed` (None stays None)."""
    if seed is None or index == 0:
        return seed
    return (seed + index * _MIX) & _MASK


def choice_rid(rid: str, index: int) -> str:
    """The engine's id of choice `index` (choice 0 keeps the request's own rid)."""
    return rid if index == 0 else f"{rid}#{index}"


def add_choices(parent: Req, n: int) -> None:
    """Make `parent` choice 0 of n and hang choices 1..n-1 on it (nothing is allocated)."""
    if n <= 1:
        return
    parent.choice.group = parent.rid
    sp, lp = parent.sampling, parent.logprobs
    parent.choice.forks = [
        Req(rid=choice_rid(parent.rid, i), token_ids=parent.token_ids[: parent.num_prompt_tokens],
            sampling=dataclasses.replace(sp, seed=choice_seed(sp.seed, i)), stream=parent.stream,
            logprobs=LogprobState(LogprobParams(on=lp.on, top_k=lp.top_k)), pd=parent.pd, created=parent.created,
            resumed_tokens=parent.resumed_tokens, choice=Choice(group=parent.rid, index=i),
            options=parent.options)  # one cache namespace
        for i in range(1, n)
    ]


def choices(r: Req) -> list[Req]:
    """r and the choices still waiting on it."""
    return [r, *r.choice.forks]
