"""Speculative decoding totals of one scheduler (engine.stats.SchedulerStats.spec; service/metrics.py
declares their metrics). Plain ints: totals only grow while the process lives."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    method: str = ""  # "" (off), ngram or draft
    proposed_tokens: int = 0  # total: draft tokens sent to a verify
    accepted_tokens: int = 0  # total: draft tokens the target accepted
    verify_steps: int = 0  # total: (request, step) pairs that ran a verify
    emitted_tokens: int = 0  # total: tokens those verifies emitted (accepted drafts + the target's own)
    switched_off: int = 0  # total: times a request's acceptance fell below the threshold (it pauses)
    batch_off_steps: int = 0  # total: steps where the batch was too large for anyone to speculate

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step of a request (1 = no draft ever accepted; 0 before any)."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0
