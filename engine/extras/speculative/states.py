"""Speculation on hybrid models: per-position state checkpoints and their rollback.

A recurrent layer's state after a verify of [last] + K drafts has taken in all K+1 positions; when
drafts are rejected the request continues from an earlier position, whose state the slot no longer
holds (attention only needs its KV pages cut back: KVManager.rollback). So before the verify each
speculating request takes K slots of the state pool's verify share (KVManager.take_verify_slots,
--speculative-max-batch x K of them, sized at start-up: engine.config `state_verify_slots`), and the
forward writes into slot j the state after position j (j = 0 .. K-1; the state after position K is
the request's own slot, as a plain decode leaves it): the recurrent kernels run a verify one position
at a time for this (engine/recurrent/batch.py `checkpoints`). After acceptance, kv_len advanced by e
tokens means positions 0 .. e-1 were kept: when e <= K the request's slot takes checkpoint e-1 (a
copy: StatePool.copy, a rank op under TP), and the verify slots go back to the share. A request the
share has no slots for this step decodes plainly (its draft dropped).

The state's prefix-cache snapshots are taken after the settle (Scheduler._postprocess), from the
rolled-back slot, so a verify never leaves a snapshot of rejected positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.kvcache.kv_manager import KVManager
from engine.request import Req


@dataclass(frozen=True)
class PositionStates:
    """A verify segment's checkpoint slots (`Segment.extras`: engine/forward/batch.py adds it)."""

    slots: tuple[int, ...]

    def add(self, batch: Any, seg: int, row: int) -> None:
        if batch.state_checkpoints is None:
            batch.state_checkpoints = [()] * len(batch.new_lens)
        batch.state_checkpoints[seg] = self.slots


def reserve(running: list[Req], kv: KVManager) -> None:
    """Before the forward: give every request with a draft and a state slot its checkpoint slots
    (len(draft) of them), or drop its draft when the verify share has none left."""
    for r in running:
        s = r.spec
        if not s.draft or r.kv.state_slot < 0:
            continue
        slots = kv.take_verify_slots(len(s.draft))
        if not slots:
            s.draft, s.draft_probs = [], None
            continue
        s.states, s.base = slots, r.kv.kv_len


def settle(r: Req, kv: KVManager) -> None:
    """After r's verify (kv_len advanced past the kept positions): roll its state back to the last
    kept position and free the checkpoint slots."""
    s = r.spec
    if not s.states:
        return
    kept = r.kv.kv_len - s.base  # positions 0 .. kept-1 of the verify were kept
    if 1 <= kept <= len(s.states):
        kv.states.copy(s.states[kept - 1], r.kv.state_slot)  # type: ignore[union-attr]
    release(r, kv)


def release(r: Req, kv: KVManager) -> None:
    """Free r's checkpoint slots, if it holds any."""
    kv.free_verify_slots(r.spec.states)
    r.spec.states = []
