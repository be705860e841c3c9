"""Token sampling from fp32 logits: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self, default_seed: int = 0) -> None:
        self.default_seed = default_seed
        self._gens: dict[str, torch.Generator] = {}

    def forget(self, rid: str) -> None:
        self._gens.pop(rid, None)

    def _gen(self, rid: str, sp: SamplingParams) -> torch.Generator:
        g = self._gens.get(rid)
        if g is None:
            g = torch.Generator()
            seed = sp.seed if sp.seed is not None else hash((self.default_seed, rid)) & (2**63 - 1)
            g.manual_seed(seed)
            self._gens[rid] = g
        return g

    def sample(self, logits: torch.Tensor, rids: list[str], params: list[SamplingParams],
               want_logprobs: bool) -> tuple[list[int], list[float]]:
        """logits: fp32 [B, V] -> (token ids [B], logprobs of the chosen tokens [B] or [])."""
        greedy = torch.argmax(logits, dim=-1)
        tokens = greedy.tolist()
        for i, sp in enumerate(params):
            if sp.greedy:
                continue
            row = logits[i].float().cpu() / sp.temperature
            probs = torch.softmax(row, dim=-1)
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
            tokens[i] = int(torch.multinomial(probs / probs.sum(), 1, generator=self._gen(rids[i], sp)))
        logprobs: list[float] = []
        if want_logprobs:
            lp = torch.log_softmax(logits.float(), dim=-1)
            idx = torch.tensor(tokens, device=logits.device).unsqueeze(1)
            logprobs = lp.gather(1, idx).squeeze(1).tolist()
        return tokens, logprobs
