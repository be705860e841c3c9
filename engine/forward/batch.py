"""One model step over a mixed batch: extend items (prompt chunks) plus decode requests.

`BatchExecutor.run` does the forward and the bookkeeping after it: advances kv.kv_len, collects
prompt logprobs (only the rows a request asked for), samples the next token for requests whose
prompt is now fully cached and for every decode request (with logprobs when asked), and applies stop
conditions. A request with forks (n > 1, engine.scheduling.parallel) has each fork's first token sampled from
its own last prompt row as well, each with the fork's own seed. Pages must already be allocated (KVManager.grow).
A decode request with a speculative draft (`req.spec.draft`, engine/extras/speculative) runs its last token
plus the draft as one segment with logits at every position; engine.extras.speculative.verify emits its tokens.

Prepare, run, sample: `_segments` turns the step's requests into segments, each with what its extras
add to the batch (`Segment.extras`: input embeddings and hidden-state capture from
engine/extras/features.py, the LoRA adapter from engine/extras/lora/batch.py); `forward_segments`
builds the ForwardBatch once and runs it; the logits rows then go to the sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.extras import features, multimodal
from engine.extras.lora.batch import Adapter
from engine.extras.speculative.states import PositionStates
from engine.extras.speculative.verify import verify
from engine.forward.forward_batch import (
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    BatchExtra,
    Runner,
    Segment,
    forward_segments,
)
from engine.request import Req
from engine.sampling.logprobs import TopK, token_logprobs
from engine.sampling.sampler import Sampler
from engine.sampling.stops import StopChecker


@dataclass
class ExtendItem:
    req: Req
    num_tokens: int  # prompt tokens computed this step, from req.kv.kv_len
    completes_prompt: bool = False  # fixed at planning time, before kv_len advances

    def __post_init__(self) -> None:
        self.completes_prompt = self.req.kv.kv_len + self.num_tokens >= len(self.req.token_ids)


@dataclass
class StepResult:
    extended: list[ExtendItem]
    decoded: list[Req]
    sampled: list[Req]  # requests that got a new token this step (first tokens + decodes)


class BatchExecutor:
    def __init__(self, runner: Runner, sampler: Sampler, stops: StopChecker) -> None:
        self.runner = runner
        self.sampler = sampler
        self.stops = stops
        self.forward_tokens = 0
        self.encoder: multimodal.Encoder | None = None  # vision-language models: built at the first image

    def run(self, extend: list[ExtendItem], decode: list[Req]) -> StepResult:
        if any(it.req.mm is not None for it in extend) or any(r.mm is not None for r in decode):
            self._images(extend, decode)
        segments = _segments(extend, decode)
        if not segments:
            return StepResult([], [], [])
        self.forward_tokens += sum(len(s.tokens) for s in segments)
        out = forward_segments(self.runner, segments)
        logits, hidden = out.logits, out.hidden  # hidden: None unless a segment captures its hidden states

        to_sample: list[tuple[Req, torch.Tensor]] = []
        verified: list[tuple[Req, torch.Tensor]] = []  # speculative decodes: rows [K+1, V]
        for i, (it, seg, lg) in enumerate(zip(extend, segments, logits[: len(extend)])):
            r = it.req
            if hidden is not None:
                features.collect(hidden[i], r.features, prompt=True)
            if seg.logits == LOGITS_ALL and lg is not None:
                _input_logprobs(r, r.kv.kv_len + seg.skip, lg)
                lg = lg[-1]
            r.kv.kv_len += it.num_tokens
            if it.completes_prompt:
                if r.mm is not None:
                    r.mm.release()
                r.logprobs.input_done = r.logprobs.wants_input
                to_sample.append((r, lg))
                to_sample.extend((f, lg) for f in r.choice.forks)  # n > 1: each choice draws from this row
        for i, (r, lg) in enumerate(zip(decode, logits[len(extend) :]), len(extend)):
            if hidden is not None:
                features.collect(hidden[i], r.features, prompt=False)
            if r.spec.draft:  # emitted below by the acceptance rule, kv_len advanced there
                verified.append((r, lg))
                continue
            r.kv.kv_len += 1
            to_sample.append((r, lg))
        sampled = self._sample(to_sample)
        for r, lg in verified:
            verify(r, lg, self.sampler, self.stops)
            sampled.append(r)
        return StepResult(extend, decode, sampled)

    def _images(self, extend: list[ExtendItem], decode: list[Req]) -> None:
        """Bind the M-RoPE positions of requests with images, and run the vision tower for the images the
        step's prompt chunks cover (engine.extras.multimodal)."""
        cfg = self.runner.model_cfg
        need: list[multimodal.Image] = []
        for r in [it.req for it in extend] + decode:
            if r.mm is not None and r.mm.positions is None:
                r.mm.bind(r.token_ids[: r.num_prompt_tokens], cfg)
        for it in extend:
            if it.req.mm is not None:
                need += multimodal.needed(it.req.mm, it.req.kv.kv_len, it.num_tokens)
        if need:
            if self.encoder is None:
                run = self.runner
                self.encoder = multimodal.Encoder(run.model, run.device, run.dtype, run.cfg.image_cache_mb << 20)
            self.encoder.encode(need)

    def _sample(self, items: list[tuple[Req, torch.Tensor]]) -> list[Req]:
        if not items:
            return []
        reqs = [r for r, _ in items]
        logits = torch.stack([lg for _, lg in items])  # [B, V] fp32
        tokens = self.sampler.sample(logits, reqs)
        want = [i for i, r in enumerate(reqs) if r.logprobs.on]
        if want:  # only the rows that asked: no softmax over the vocabulary otherwise
            k = max(reqs[i].logprobs.top_k for i in want)
            lps, tops = token_logprobs(logits[want], [tokens[i] for i in want], k)
            for j, i in enumerate(want):
                lp = reqs[i].logprobs
                lp.output.append(lps[j])
                if lp.top_k:
                    lp.output_top.append(_first(tops[j], lp.top_k))
                if reqs[i].features.ids:  # token_ids_logprob
                    reqs[i].features.ids_output += features.ids_logprobs(logits[i : i + 1], reqs[i].features.ids)
        for i, r in enumerate(reqs):
            r.append_token(tokens[i])
            self.stops.check(r)
        return reqs


def _segments(extend: list[ExtendItem], decode: list[Req]) -> list[Segment]:
    """The step's segments: each extend item's prompt chunk, then each decode request's last token (plus
    its speculative draft), each with what the request's extras add to the batch (no call for a
    request without extras: this runs for every request of every step)."""
    segments: list[Segment] = []
    extras: tuple[BatchExtra, ...]
    for it in extend:
        r = it.req
        mode, skip = _logit_rows(it)
        start = r.kv.kv_len
        extras = features.prepare(r.features, start, it.num_tokens, prompt=True) if r.features.active else ()
        if r.mm is not None:
            extras = (*extras, *multimodal.prepare(r.mm, start, it.num_tokens, prompt=True))
        if r.lora:
            extras = (*extras, Adapter(r.lora))
        segments.append(Segment(r.kv.pages, start, r.token_ids[start : start + it.num_tokens], mode, skip, extras,
                                r.kv.state_slot))
    for r in decode:
        assert len(r.token_ids) == r.kv.kv_len + 1, "decode request must have exactly one uncached token"
        draft = r.spec.draft  # speculative: verify [last] + draft, logits at every position
        extras = features.prepare(r.features, r.kv.kv_len, 1, prompt=False) if r.features.active else ()
        if r.mm is not None:
            extras = (*extras, *multimodal.prepare(r.mm, r.kv.kv_len, 1 + len(draft), prompt=False))
        if r.lora:
            extras = (*extras, Adapter(r.lora))
        if r.spec.states:  # a hybrid model's verify: the state after each position (speculative/states.py)
            extras = (*extras, PositionStates(tuple(r.spec.states)))
        segments.append(Segment(r.kv.pages, r.kv.kv_len, r.token_ids[-1:] + draft,
                                LOGITS_ALL if draft else LOGITS_LAST, 0, extras, r.kv.state_slot))
    return segments


def _first(top: TopK, k: int) -> TopK:
    return top[0][:k], top[1][:k]


def _logit_rows(it: ExtendItem) -> tuple[int, int]:
    """(logits mode, rows skipped) of an extend item's segment. Prompt logprobs from position s need
    the rows of positions s-1 .. len-2 (row p predicts token p+1); the last prompt row is sampled."""
    r = it.req
    if r.logprobs.wants_input:
        first = max(r.logprobs.start_len, 1) - 1  # the first position whose row is needed
        end = r.kv.kv_len + it.num_tokens  # this chunk covers positions kv_len .. end-1
        if first < end:  # first <= len-2, so a chunk that completes the prompt always has its last row
            return LOGITS_ALL, max(0, first - r.kv.kv_len)
    return (LOGITS_LAST if it.completes_prompt else LOGITS_NONE), 0


def _input_logprobs(r: Req, pos0: int, lg: torch.Tensor) -> None:
    """lg: fp32 [n, V], the rows of positions pos0 .. pos0+n-1; row p scores prompt token p+1."""
    n = min(lg.shape[0], r.num_prompt_tokens - 1 - pos0)  # the last prompt row scores no prompt token
    if n <= 0:
        return
    lps, tops = token_logprobs(lg[:n], r.token_ids[pos0 + 1 : pos0 + 1 + n], r.logprobs.top_k)
    r.logprobs.input.extend(lps)
    r.logprobs.input_top.extend(tops)
    if r.features.ids:  # token_ids_logprob at the same prompt positions
        r.features.ids_input += features.ids_logprobs(lg[:n], r.features.ids)
