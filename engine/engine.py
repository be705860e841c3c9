"""Offline engine API: generate for a list of prompts in one continuous batch (tests, benchmarks)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from transformers import AutoTokenizer

from engine.config import EngineConfig
from engine.forward.forward_batch import LOGITS_ALL, Segment, forward_segments
from engine.forward.model_runner import ModelRunner
from engine.kvcache.memory import pages_for
from engine.request import LogprobState, Req
from engine.request_groups import LogprobParams, ReqOptions
from engine.sampling.params import SamplingParams
from engine.scheduling.scheduler import Scheduler


@dataclass
class Completion:
    rid: str
    prompt_ids: list[int]
    output_ids: list[int]
    text: str
    finish_reason: str
    error: str | None
    output_logprobs: list[float]
    input_logprobs: list[float]
    retractions: int


class LLM:
    def __init__(self, cfg: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.cfg = cfg
        self.runner = runner or ModelRunner(cfg)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.runner.model_path))
        self.scheduler = Scheduler(self.runner, cfg)
        self._ids = itertools.count()

    def encode(self, prompt: str | list[int]) -> list[int]:
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams],
                 return_logprob: bool = False, loras: list[str] | None = None) -> list[Completion]:
        """`loras`: each prompt's LoRA adapter name ("" = the base model; engine/extras/lora), loaded on the runner."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        names = loras or [""] * len(prompts)
        for n in set(names) - {""}:
            if self.runner.lora is None or n not in self.runner.lora.adapters:
                raise ValueError(f"loras: LoRA adapter {n!r} is not loaded (EngineConfig.lora_paths)")
        reqs = [Req(rid=f"offline-{next(self._ids)}", token_ids=self.encode(p), sampling=sp,
                    logprobs=LogprobState(LogprobParams(on=return_logprob, start_len=0 if return_logprob else -1)),
                    options=ReqOptions(lora=name))
                for p, sp, name in zip(prompts, plist, names)]
        for r in reqs:
            self.scheduler.add(r)
        pending = {r.rid for r in reqs}
        while pending:
            self.scheduler.step()
            for r in self.scheduler.drain():
                if r.finished:
                    pending.discard(r.rid)
        return [self._completion(r) for r in reqs]

    def _completion(self, r: Req) -> Completion:
        return Completion(
            rid=r.rid, prompt_ids=r.input_ids, output_ids=r.output_ids,
            text=self.tokenizer.decode(r.output_ids, skip_special_tokens=True),
            finish_reason=r.finish_reason.value if r.finish_reason else "", error=r.error,
            output_logprobs=list(r.logprobs.output), input_logprobs=list(r.logprobs.input),
            retractions=r.kv.retractions,
        )

    def prompt_logits(self, ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """Teacher-forced fp32 logits [n, V] for a prompt, computed in chunks over the paged cache."""
        chunk = chunk or self.cfg.chunked_prefill_size
        alloc, states = self.runner.pool.allocator, self.runner.states
        pages = alloc.allocate(pages_for(len(ids), self.runner.page_size))
        slot = -1 if states is None else states.allocate(1)[0]  # a hybrid model's recurrent state
        try:
            out = [forward_segments(self.runner, [Segment(pages, s, ids[s : s + chunk], LOGITS_ALL, slot=slot)]
                                    ).logits[0] for s in range(0, len(ids), chunk)]
        finally:
            alloc.free(pages)
            if states is not None:
                states.free([slot])
        return torch.cat(out)  # type: ignore[arg-type]
