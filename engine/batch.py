"""One model step over a mixed batch: extend items (prompt chunks) plus decode requests.

`BatchExecutor.run` does the forward and the bookkeeping after it: advances kv_len, collects
input logprobs, samples the next token for requests whose prompt is now fully cached and for every
decode request, and applies stop conditions. Pages must already be allocated (KVManager.grow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model_runner import LOGITS_ALL, LOGITS_LAST, LOGITS_NONE, ModelRunner, Segment
from engine.request import Req, StopChecker
from engine.sampling import Sampler


@dataclass
class ExtendItem:
    req: Req
    num_tokens: int  # prompt tokens computed this step, from req.kv_len
    completes_prompt: bool = False  # fixed at planning time, before kv_len advances

    def __post_init__(self) -> None:
        self.completes_prompt = self.req.kv_len + self.num_tokens >= len(self.req.fill_ids)


@dataclass
class StepResult:
    extended: list[ExtendItem]
    decoded: list[Req]
    sampled: list[Req]  # requests that got a new token this step (first tokens + decodes)


class BatchExecutor:
    def __init__(self, runner: ModelRunner, sampler: Sampler, stops: StopChecker) -> None:
        self.runner = runner
        self.sampler = sampler
        self.stops = stops
        self.forward_tokens = 0

    def run(self, extend: list[ExtendItem], decode: list[Req]) -> StepResult:
        segments: list[Segment] = []
        for it in extend:
            r = it.req
            mode = LOGITS_ALL if r.return_logprob else (LOGITS_LAST if it.completes_prompt else LOGITS_NONE)
            segments.append(Segment(r.pages, r.kv_len, r.fill_ids[r.kv_len : r.kv_len + it.num_tokens], mode))
        for r in decode:
            assert len(r.fill_ids) == r.kv_len + 1, "decode request must have exactly one uncached token"
            segments.append(Segment(r.pages, r.kv_len, [r.fill_ids[-1]], LOGITS_LAST))
        if not segments:
            return StepResult([], [], [])
        self.forward_tokens += sum(len(s.tokens) for s in segments)
        logits = self.runner.forward(segments)

        to_sample: list[tuple[Req, torch.Tensor]] = []
        for it, lg in zip(extend, logits[: len(extend)]):
            r = it.req
            if r.return_logprob and lg is not None:
                self._input_logprobs(r, it.num_tokens, lg)
                lg = lg[-1]
            r.kv_len += it.num_tokens
            if it.completes_prompt:
                to_sample.append((r, lg))
        for r, lg in zip(decode, logits[len(extend) :]):
            r.kv_len += 1
            to_sample.append((r, lg))
        sampled = self._sample(to_sample)
        return StepResult(extend, decode, sampled)

    def _input_logprobs(self, r: Req, n: int, lg: torch.Tensor) -> None:
        # row j predicts the token at position kv_len + j + 1 (only prompt tokens count)
        start = r.kv_len
        end = min(start + n, len(r.input_ids) - 1)
        if end <= start:
            return
        lp = torch.log_softmax(lg[: end - start], dim=-1)
        targets = torch.tensor(r.input_ids[start + 1 : end + 1], device=lp.device).unsqueeze(1)
        r.input_logprobs.extend(lp.gather(1, targets).squeeze(1).tolist())

    def _sample(self, items: list[tuple[Req, torch.Tensor]]) -> list[Req]:
        if not items:
            return []
        reqs = [r for r, _ in items]
        logits = torch.stack([lg for _, lg in items])  # [B, V] fp32
        want_lp = any(r.return_logprob for r in reqs)
        tokens, lps = self.sampler.sample(logits, reqs, want_lp)
        for i, r in enumerate(reqs):
            r.output_ids.append(tokens[i])
            if r.return_logprob:
                r.output_logprobs.append(lps[i])
            self.stops.check(r)
        return reqs
