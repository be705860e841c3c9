"""Token sampling from fp32 logits: logit processors (penalties, min_new_tokens, logit_bias), the
grammar mask of structured-output rows (engine.sampling.grammar), then greedy, temperature, top-k, top-p, min-p.

Seeded sampling is keyed by position: the draw for a request's k-th output token uses a generator
seeded from (seed, k) alone. The same request therefore gets the same text whoever samples which
token: colocated, or the first token on a prefill and the rest on a decode, alone or in any batch,
and after a migration to another worker. Without a seed, the key is (the engine's default seed,
the request id), hashed stably.

Logprobs are those of the model's own distribution (log_softmax of the raw logits), before any
processor or temperature.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import torch

from engine.sampling.grammar import Grammars, GrammarSpec, Matcher, accept, mask_rows
from engine.sampling.params import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads consecutive keys apart
_MASK = (1 << 63) - 1


class Sampled(Protocol):
    """What the sampler reads of a request."""

    rid: str
    token_ids: list[int]  # prompt then output
    num_prompt_tokens: int
    sampling: SamplingParams
    resumed_tokens: int  # the prompt's last N ids are output of an earlier leg (migration)
    grammar: Matcher | None  # the grammar matcher of a structured-output request (set by the sampler)

    @property
    def num_output_tokens(self) -> int: ...


def generated(r: Sampled) -> list[int]:
    """Every token the request generated so far, including those an earlier decode streamed before a
    migration (the tail of its prompt now): seeded positions and the penalties count them all."""
    return r.token_ids[r.num_prompt_tokens - r.resumed_tokens :]


def draw_seed(sp: SamplingParams, rid: str, default_seed: int, position: int) -> int:
    """The generator seed of one draw: a function of (seed, position) only."""
    base = sp.seed if sp.seed is not None else (default_seed << 32) ^ zlib.crc32(rid.encode())
    return ((base * _MIX) ^ (position + 1) * 0xBF58476D1CE4E5B9) & _MASK


def process_logits(row: torch.Tensor, r: Sampled, eos_ids: Sequence[int]) -> torch.Tensor:
    """Apply the request's logit processors to one row of logits (fp32 [V]); returns a new row.
    In order: repetition penalty over prompt and output tokens (a positive logit is divided by it,
    a negative one multiplied, as in CTRL and transformers), frequency and presence penalties over
    output tokens (OpenAI: logit -= frequency * count + presence * (count > 0)), logit_bias, and
    while fewer than min_new_tokens were generated, EOS and stop_token_ids banned."""
    sp = r.sampling
    row = row.clone()
    out = generated(r)
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(r.token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and out:
        counts = Counter(out)
        ids = torch.tensor(list(counts), dtype=torch.long)
        n = torch.tensor(list(counts.values()), dtype=row.dtype)
        row[ids] -= sp.frequency_penalty * n + sp.presence_penalty
    for tok, bias in sp.logit_bias:
        row[tok] += bias
    if r.num_output_tokens < sp.min_new_tokens:  # a resumed request's min is already net of its earlier leg
        banned = [t for t in (*eos_ids, *sp.stop_token_ids) if 0 <= t < row.shape[0]]
        if banned:
            row[torch.tensor(banned, dtype=torch.long)] = float("-inf")
    return row


class Sampler:
    """`grammars` compiles structured-output requests' grammars (None: no request may carry one)."""

    def __init__(self, default_seed: int = 0, eos_ids: Sequence[int] = (), grammars: Grammars | None = None) -> None:
        self.default_seed = default_seed
        self.eos_ids = tuple(eos_ids)
        self.grammars = grammars

    def sample(self, logits: torch.Tensor, reqs: Sequence[Sampled]) -> list[int]:
        """logits: fp32 [B, V] -> token ids [B] (logprobs: engine.sampling.logprobs, from the raw logits).
        Rows that are greedy with no processor and no grammar take the batch argmax; the others are
        processed on the CPU, grammar rows masked together, then picked one by one."""
        tokens = torch.argmax(logits, dim=-1).tolist()
        slow = [i for i, r in enumerate(reqs) if not r.sampling.greedy or r.sampling.has_processors
                or r.sampling.has_grammar]
        if not slow:
            return tokens
        rows = logits[slow].float().cpu()  # [n, V], a copy
        matchers = [self._matcher(reqs[i]) for i in slow]
        both = any(m is not None and reqs[i].sampling.has_processors for m, i in zip(matchers, slow))
        raw = rows.clone() if both else None  # the logits before processors, for the fallback below
        for j, i in enumerate(slow):
            if reqs[i].sampling.has_processors:
                rows[j] = process_logits(rows[j], reqs[i], self.eos_ids)
        if any(m is not None for m in matchers):
            mask_rows(rows, matchers)
            for j, m in enumerate(matchers):  # processors and grammar forbid every token (min_tokens
                if m is not None and raw is not None and torch.isneginf(rows[j]).all():  # vs. the end)
                    rows[j] = raw[j]
                    mask_rows(rows[j : j + 1], [m])  # the grammar wins
        for j, i in enumerate(slow):
            r = reqs[i]
            tokens[i] = int(torch.argmax(rows[j])) if r.sampling.greedy else self._draw(rows[j], r)
            if matchers[j] is not None:
                accept(matchers[j], tokens[i])
        return tokens

    def _matcher(self, r: Sampled) -> Matcher | None:
        """The request's grammar matcher, built on its first sample past the tokens it already has."""
        spec = GrammarSpec.of(r.sampling)
        if spec is None:
            return None
        if r.grammar is None:
            if self.grammars is None:
                raise ValueError("this sampler has no grammar compiler")
            r.grammar = self.grammars.matcher(spec, generated(r))
        return r.grammar

    def probs(self, row: torch.Tensor, r: Sampled) -> torch.Tensor:
        """The distribution a non-greedy draw for r takes from one row of raw logits (fp32 [V] ->
        [V], summing to 1): processors, then temperature, top-k, top-p and min-p (no grammar).
        Speculative decoding's rejection rule reads it (engine.extras.speculative.verify)."""
        row = row.float().cpu()
        if r.sampling.has_processors:
            row = process_logits(row, r, self.eos_ids)
        probs = final_probs(row, r.sampling)
        return probs / probs.sum()

    def _draw(self, row: torch.Tensor, r: Sampled) -> int:
        sp = r.sampling
        probs = final_probs(row, sp)
        g = torch.Generator()
        g.manual_seed(draw_seed(sp, r.rid, self.default_seed, len(generated(r))))
        return int(torch.multinomial(probs / probs.sum(), 1, generator=g))


def final_probs(row: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Processed logits (fp32 [V]) -> the unnormalised probabilities a draw picks from: softmax at the
    temperature, then top-k, top-p and min-p zero the tokens they drop."""
    probs = torch.softmax(row / sp.temperature, dim=-1)
    if sp.top_k > 0 and sp.top_k < probs.shape[-1]:
        kth = torch.topk(probs, sp.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if sp.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > sp.top_p * cum[-1]
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if sp.min_p > 0.0:
        probs = torch.where(probs >= sp.min_p * probs.max(), probs, torch.zeros_like(probs))
    return probs
