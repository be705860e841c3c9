"""Who speculates this step (the switch-off rule).

- The batch: when more than `speculative_max_batch` requests decode, a step is compute-bound (K+1
  positions per request cost about K+1 times a decode's compute), so nobody speculates.
- A request: structured-output (grammar) requests never speculate (documented: each position would
  need the grammar matcher advanced and rolled back), nor do requests asking for hidden states or
  token_ids_logprob (recorded once per decode step). Otherwise its acceptance is a running average
  over its verifies (half weight on the newest); when it falls below `speculative_min_acceptance`
  the request pauses for a number of steps that doubles on each consecutive pause (4 .. 64), then
  tries again, so a request whose text turns repetitive later speculates again.
- The draft length is capped so a verify never runs past max_new_tokens or the context length.
"""

from __future__ import annotations

from engine.extras.speculative.config import SpecConfig
from engine.request import Req

MIN_PAUSE, MAX_PAUSE = 4, 64


class SwitchOff:
    def __init__(self, cfg: SpecConfig, context_length: int) -> None:
        self.cfg = cfg
        self.context_length = context_length

    def batch_on(self, running: int) -> bool:
        return running <= self.cfg.speculative_max_batch

    def draft_len(self, r: Req) -> int:
        """Tokens r may propose this step (0: it decodes plainly). Counts down a pause."""
        f = getattr(r, "features", None)  # hidden states / token_ids_logprob are recorded per decode step
        if r.sampling.has_grammar or (f is not None and (f.hidden or f.ids)):
            return 0
        if r.spec.skip > 0:
            r.spec.skip -= 1
            return 0
        left = r.sampling.max_new_tokens - r.num_output_tokens - 1  # the verify emits up to K+1
        room = self.context_length - len(r.token_ids)
        return max(0, min(self.cfg.k, left, room))

    def record(self, r: Req, proposed: int, accepted: int) -> bool:
        """Fold one verify into r's acceptance; returns whether r pauses now."""
        s = r.spec
        s.proposed_total += proposed
        s.accepted_total += accepted
        ratio = accepted / proposed
        s.rate = 0.5 * s.rate + 0.5 * ratio
        if ratio >= self.cfg.speculative_min_acceptance:
            s.backoff //= 2
        if s.rate >= self.cfg.speculative_min_acceptance:
            return False
        s.backoff = min(max(2 * s.backoff, MIN_PAUSE), MAX_PAUSE)
        s.skip = s.backoff
        s.rate = self.cfg.speculative_min_acceptance  # one bad verify after the pause pauses it again
        return True
