"""Speculator: the Scheduler's one hook object for speculative decoding (None when off).

Per step (engine.scheduling.scheduler.Scheduler):
1. `propose(running)` before pages are grown: each running request gets `spec.draft` (up to K
   tokens; [] = a plain decode) from the n-gram lookup or the draft model, as the switch-off rule
   allows (engine.extras.speculative.policy). `kv.grow` then covers 1 + len(draft) tokens.
   When pages are short, `drop(running)` clears every draft before anyone is retracted. On a hybrid
   model `reserve(running)`, once pages are grown, gives each draft its position-state slots
   (engine/extras/speculative/states.py).
2. The batch executor runs a request with a draft as an extend of [last token] + draft over its
   cached KV with logits at every position (LOGITS_ALL), and `verify.verify` emits its tokens.
3. `settle(decoded)` after the forward: totals and the switch-off rule, then the rollback of
   rejected positions (KVManager.rollback frees whole pages past kv_len; the draft model's own KV
   likewise; a hybrid model's state goes back to its last kept position). `forget(r)` frees a
   finished request's draft-model KV.
"""

from __future__ import annotations

from typing import Protocol

from engine.extras.speculative import ngram, states
from engine.extras.speculative.config import SpecConfig
from engine.extras.speculative.policy import SwitchOff
from engine.extras.speculative.stats import SpecStats
from engine.kvcache.kv_manager import KVManager
from engine.request import Req


class Proposer(Protocol):
    """The draft model's side (engine.forward.draft.DraftProposer)."""

    def propose(self, reqs: list[Req], lens: list[int]) -> None: ...
    def rollback(self, r: Req) -> None: ...
    def forget(self, r: Req) -> None: ...
    def retain(self, running: list[Req]) -> None: ...
    def used_pages(self) -> int: ...


class Speculator:
    def __init__(self, cfg: SpecConfig, kv: KVManager, context_length: int, draft: Proposer | None = None) -> None:
        self.cfg, self.kv, self.draft = cfg, kv, draft
        self.policy = SwitchOff(cfg, context_length)
        self.totals = SpecStats(method=cfg.speculative)

    def propose(self, running: list[Req]) -> None:
        """Set every running request's draft for this step ([] for those that do not speculate)."""
        for r in running:
            r.spec.draft, r.spec.draft_probs, r.spec.accepted = [], None, -1
        if self.draft is not None:
            self.draft.retain(running)  # retracted requests catch up again when reloaded
        if not running:
            return
        if not self.policy.batch_on(len(running)):
            self.totals.batch_off_steps += 1
            return
        chosen, lens = [], []
        for r in running:
            n = self.policy.draft_len(r)
            if n > 0:
                chosen.append(r)
                lens.append(n)
        if self.draft is not None:
            self.draft.propose(chosen, lens)
            return
        for r, n in zip(chosen, lens):
            r.spec.draft = ngram.propose(r.token_ids, n, self.cfg.ngram_min, self.cfg.ngram_max)

    @staticmethod
    def drop(running: list[Req]) -> None:
        """Too few free pages for the drafts: everyone decodes one token this step."""
        for r in running:
            r.spec.draft, r.spec.draft_probs = [], None

    def reserve(self, running: list[Req]) -> None:
        """A hybrid model: each draft's position-state slots (a draft the verify share cannot take is dropped)."""
        if self.kv.states is not None:
            states.reserve(running, self.kv)

    def settle(self, decoded: list[Req]) -> None:
        """After the forward: fold each verify into the totals and the switch-off rule, and free the
        KV of rejected positions (target and draft)."""
        t = self.totals
        for r in decoded:
            s = r.spec
            if s.accepted < 0:
                states.release(r, self.kv)
                continue
            states.settle(r, self.kv)  # before anything reads the state (the prefix cache's snapshots)
            proposed = len(s.draft)
            t.proposed_tokens += proposed
            t.accepted_tokens += s.accepted
            t.verify_steps += 1
            t.emitted_tokens += s.accepted + 1
            t.switched_off += self.policy.record(r, proposed, s.accepted)
            s.draft, s.draft_probs, s.accepted = [], None, -1
            self.kv.rollback(r)
            if self.draft is not None:
                self.draft.rollback(r)

    def forget(self, r: Req) -> None:
        """r left the running batch for good (finished, aborted): free its draft-model KV."""
        states.release(r, self.kv)
        if self.draft is not None:
            self.draft.forget(r)

    def stats(self) -> SpecStats:
        return self.totals

