"""A hybrid model's recurrent state between a TP group's ranks and PD's wire (the `state_gather` /
`state_scatter` rank ops), the counterpart of tp_kv.py's pages for the state slot.

A rank's state pool holds its rows of every part (engine/recurrent/state_pool.py: `StatePart.rows`: its
heads of a recurrent state, its channels of a conv state; a Mamba2 B/C group may be held by several
ranks). The wire carries the whole state in the TP-independent layout (`StateSpec.full()`: a TP 1
rank's slot, byte for byte), so any prefill TP talks to any decode TP and TP 1 <-> TP 1 sends the
slot as it is.

- `gather_state` (prefill): every rank hands its slot row to rank 0 (one `dist.gather` of slot_bytes
  each), which writes each rank's rows into the whole state (a replicated row from any holder: they
  are equal) and returns it, uint8 [whole slot bytes].
- `scatter_state` (decode): rank 0 holds the received whole state; it cuts each rank's rows out of
  it and `dist.scatter`s them (each rank receives only its own slot_bytes), every rank copies them
  into the same slot id (rank 0's slot ids are every rank's).

Rank 0 knows every rank's rows from its own model (`Model.state_spec(TPGroup(rank=r, size=n))`:
the slicing is a function of the rank, `rank_specs`), checked at start-up to cover every row.
Both are collectives on the worker thread (`runner.collective`), never on a transfer thread; with
TP 1 they run locally.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from engine.distributed.tp import SINGLE, TPGroup
from engine.distributed.tp_ranks import rank_op
from engine.forward.model_runner import ModelRunner
from engine.recurrent.state_pool import StateSpec, check_cover, from_full, to_full

if TYPE_CHECKING:
    from engine.distributed.tp_runner import AnyRunner

# rank 0's state pool -> every rank's spec, rank 0 first (weak: a later pool never finds a freed one's entry)
_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INCOMING: dict[int, torch.Tensor] = {}  # id(rank 0's state pool) -> the whole state state_scatter hands out


def rank_specs(runner: AnyRunner | ModelRunner) -> list[StateSpec]:
    """Every rank's state spec (rank 0 first) as rank 0's model slices it; ValueError if some row of
    some part is held by no rank (checked once)."""
    key = runner.states
    if key not in _SPECS:
        tp: TPGroup = getattr(runner, "tp", SINGLE)
        specs = [runner.model.state_spec(TPGroup(rank=r, size=tp.size)) for r in range(tp.size)]
        if specs[0] != runner.states.spec:  # type: ignore[union-attr]
            raise ValueError("rank 0's state pool does not have the layout its model gives rank 0")
        check_cover(specs)
        _SPECS[key] = specs
    return _SPECS[key]


def whole_spec(runner: AnyRunner | ModelRunner) -> StateSpec:
    """The wire's state layout: every part whole, whatever the TP size."""
    return runner.states.spec.full()  # type: ignore[union-attr]


def gather_state(runner: AnyRunner | ModelRunner, slot: int) -> torch.Tensor:
    """Rank 0: slot's whole state, uint8 [whole slot bytes], gathered from every rank."""
    rank_specs(runner)
    out = runner.collective(_state_gather, slot=slot)
    assert out is not None, "rank 0's state_gather returns the state"
    return out


def scatter_state(runner: AnyRunner | ModelRunner, slot: int, whole: torch.Tensor) -> None:
    """Rank 0: every rank's slot `slot` takes its rows of the whole state (uint8 [whole slot bytes])."""
    rank_specs(runner)
    key = id(runner.states)
    _INCOMING[key] = whole
    try:
        runner.collective(_state_scatter, slot=slot)
    finally:
        _INCOMING.pop(key, None)


@rank_op("state_gather")
def _state_gather(runner: ModelRunner, slot: int) -> torch.Tensor | None:
    states, tp = runner.states, runner.tp
    assert states is not None
    row = states.buffer[slot]  # uint8 [slot_bytes], this rank's rows
    if not states.spec.sliced:  # every rank holds the whole state (TP 1): the slot is the wire's layout
        return row.clone() if tp.driver else None
    rows = [torch.empty_like(row) for _ in range(tp.size)] if tp.driver else None
    dist.gather(row.contiguous(), rows, group=tp.group, group_dst=0)
    if not tp.driver:
        return None
    whole = torch.zeros(states.spec.full().layout()[1], dtype=torch.uint8, device=row.device)
    for spec, got in zip(_SPECS[states], rows):  # type: ignore[arg-type]
        to_full(spec, got, whole)
    return whole


@rank_op("state_scatter")
def _state_scatter(runner: ModelRunner, slot: int) -> None:
    states, tp = runner.states, runner.tp
    assert states is not None
    if tp.driver:
        whole = _INCOMING[id(states)].to(states.buffer.device)
        parts = [from_full(spec, whole) for spec in _SPECS[states]]  # uint8 [slot_bytes] each
        mine = parts[0]
    else:
        parts, mine = None, torch.empty(states.slot_bytes, dtype=torch.uint8, device=states.buffer.device)
    if tp.size > 1:
        dist.scatter(mine, parts, group=tp.group, group_src=0)
    states.buffer[slot].copy_(mine)  # the pool's own row, not DrivenStatePool.load (no op sent from here)
