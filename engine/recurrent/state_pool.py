"""The recurrent-state pool of a hybrid model (the seed's `mamba_pool_idx`): one slot per running
request holding every recurrent layer's convolution state and recurrent state on this rank.

Layout: one tensor `buffer` [num_slots, slot_bytes] (uint8), **slot-major** like the KV pool is
page-major: a request's whole state is one contiguous block, so retraction copies one row to the
host, a fork copies one row, and PD ships one region per request. Each named part (a layer's
"<layer>.conv" [C, K-1] in the model dtype, "<layer>.ssm" [H, d_k, d_v] or [H, P, N] in float32)
is a strided view `part(name)` [num_slots, *shape] over its byte range of every row (64-byte
aligned), which the kernels of engine/recurrent/ take as their `states` pool and update in place.

Slot 0 is reserved (never handed out), as page 0 is: a padded slot table reads harmless zeros.
The state is per request, not per token: its size is constant in the sequence's length (Qwen3-Next
80B: ~75 MB per request), so the pool is sized by requests (`--max-state-slots`), not by pages.
A new slot's contents are never read: a segment that starts its sequence runs from zeros
(`has_state` False, engine/recurrent/segments.py).

Tensor parallelism: each part of a rank's spec names the rows of the whole model's part it holds
(`StatePart.rows`, runs of its first dimension: heads of a recurrent state, channels of a conv state).
`StateSpec.full()` is the TP-independent layout (every part whole), the one PD puts on the wire:
`to_full` writes a rank's rows into it, `from_full` takes them out (service/pd.py: StateWire).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ALIGN = 64


@dataclass(frozen=True)
class StatePart:
    name: str  # "<layer>.conv" / "<layer>.ssm"
    shape: tuple[int, ...]  # per slot, this rank's
    dtype: torch.dtype
    # tensor parallelism: (first, count) runs of the whole part's first dimension that this rank's rows are,
    # in order (their counts sum to shape[0]); () = the whole part (no slicing)
    rows: tuple[tuple[int, int], ...] = ()
    full_rows: int = 0  # the whole part's first dimension (0: shape[0])

    def __post_init__(self) -> None:
        if self.rows and sum(c for _, c in self.rows) != self.shape[0]:
            raise ValueError(f"state part {self.name}: rows {self.rows} do not add up to its {self.shape[0]} rows")
        if any(f < 0 or c < 0 or f + c > self.whole for f, c in self.rows):
            raise ValueError(f"state part {self.name}: rows {self.rows} lie outside its {self.whole} whole rows")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @property
    def whole(self) -> int:
        """The whole model's first dimension of this part (every rank's rows together)."""
        return self.full_rows or self.shape[0]

    @property
    def runs(self) -> tuple[tuple[int, int], ...]:
        return self.rows or ((0, self.shape[0]),)

    @property
    def is_whole(self) -> bool:
        """Whether this rank's rows are the whole part, in order (its bytes are the whole part's)."""
        at = 0
        for first, count in self.runs:
            if first != at:
                return False
            at += count
        return at == self.whole


@dataclass(frozen=True)
class StateSpec:
    """What one request's state holds on this rank, in order (the model's `state_spec()`)."""

    parts: tuple[StatePart, ...]

    def layout(self) -> tuple[dict[str, int], int]:
        """(byte offset of each part, slot bytes), every part and the slot 64-byte aligned."""
        offsets, off = {}, 0
        for p in self.parts:
            offsets[p.name] = off
            off += -(-p.nbytes // ALIGN) * ALIGN
        return offsets, max(off, ALIGN)

    def describe(self) -> str:
        """The layout as a compatibility string: PD's two sides must agree on it byte for byte."""
        return ";".join(f"{p.name}:{'x'.join(map(str, p.shape))}:{str(p.dtype).removeprefix('torch.')}"
                        for p in self.parts)

    def full(self) -> StateSpec:
        """The TP-independent layout: every part whole (a TP 1 rank's spec), what PD sends."""
        return StateSpec(tuple(StatePart(p.name, (p.whole, *p.shape[1:]), p.dtype) for p in self.parts))

    @property
    def sliced(self) -> bool:
        """Whether this rank holds only part of some part's rows (TP > 1)."""
        return not all(p.is_whole for p in self.parts)


def _parts(spec: StateSpec, row: torch.Tensor) -> dict[str, torch.Tensor]:
    """One slot's bytes (uint8 [slot_bytes]) -> each part's view [*shape] over them."""
    offsets, size = spec.layout()
    if row.numel() != size:
        raise ValueError(f"a state of {row.numel()} bytes does not fit a {size}-byte slot")
    return {p.name: row[offsets[p.name] : offsets[p.name] + p.nbytes].view(p.dtype).view(p.shape) for p in spec.parts}


def to_full(spec: StateSpec, row: torch.Tensor, full: torch.Tensor) -> None:
    """Write a rank's state (uint8 [spec's slot_bytes]) into its rows of the whole state `full` (uint8
    [spec.full()'s slot_bytes]), in place; rows other ranks hold are left as they are."""
    mine, whole = _parts(spec, row), _parts(spec.full(), full)
    for p in spec.parts:
        at = 0
        for first, count in p.runs:
            whole[p.name][first : first + count] = mine[p.name][at : at + count]
            at += count


def from_full(spec: StateSpec, full: torch.Tensor) -> torch.Tensor:
    """A rank's state (uint8 [spec's slot_bytes]) taken out of the whole state (uint8 [spec.full()'s
    slot_bytes]): its rows of every part."""
    out = torch.zeros(spec.layout()[1], dtype=torch.uint8, device=full.device)
    mine, whole = _parts(spec, out), _parts(spec.full(), full)
    for p in spec.parts:
        mine[p.name].copy_(torch.cat([whole[p.name][first : first + count] for first, count in p.runs]))
    return out


def check_cover(specs: list[StateSpec]) -> None:
    """ValueError unless the ranks' specs (rank 0 first) together hold every row of every part."""
    for i, p in enumerate(specs[0].parts):
        held = [False] * p.whole
        for spec in specs:
            for first, count in spec.parts[i].runs:
                held[first : first + count] = [True] * count
        missing = [r for r, h in enumerate(held) if not h]
        if missing:
            raise ValueError(f"state part {p.name}: rows {missing} are held by no rank")


class StatePool:
    """`num_slots` usable slots (plus the reserved slot 0) of `spec` on `device`."""

    def __init__(self, spec: StateSpec, num_slots: int, device: torch.device | str) -> None:
        if not spec.parts:
            raise ValueError("a state pool needs at least one state part")
        self.spec = spec
        self.offsets, self.slot_bytes = spec.layout()
        if num_slots < 1:
            raise ValueError(f"a state pool needs at least one slot, got {num_slots}")
        self._free = list(range(num_slots, 0, -1))  # pop() gives low ids first; slot 0 is never handed out
        self._used: set[int] = set()
        self.buffer = torch.zeros(num_slots + 1, self.slot_bytes, dtype=torch.uint8, device=device)
        self._parts = {p.name: self._view(p) for p in spec.parts}

    def _view(self, p: StatePart) -> torch.Tensor:
        off = self.offsets[p.name]
        return self.buffer[:, off : off + p.nbytes].view(p.dtype).view(self.buffer.shape[0], *p.shape)

    def part(self, name: str) -> torch.Tensor:
        """The view [num_slots + 1, *shape] of part `name` over every slot (kernels update it in place)."""
        try:
            return self._parts[name]
        except KeyError:
            raise KeyError(f"state part {name!r} is not in this pool ({', '.join(self._parts)})") from None

    @property
    def capacity(self) -> int:
        return self.buffer.shape[0] - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def total_bytes(self) -> int:
        return self.buffer.numel()

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} state slots, {len(self._free)} free")
        slots = [self._free.pop() for _ in range(n)]
        self._used.update(slots)
        return slots

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if s not in self._used:
                raise ValueError(f"state slot {s} is not allocated (double free or foreign slot)")
            self._used.discard(s)
            self._free.append(s)

    def copy(self, src: int, dst: int) -> None:
        """Slot dst takes slot src's whole state (a fork)."""
        self.buffer[dst].copy_(self.buffer[src])

    def save(self, slot: int) -> Any:
        """A host copy of the slot's state (uint8 [slot_bytes], pinned on CUDA): retraction. What it
        returns goes back to `load` or `discard` (a tensor-parallel pool keeps every rank's copy)."""
        row = self.buffer[slot]
        if row.device.type == "cpu":
            return row.clone()
        host = torch.empty(row.shape, dtype=row.dtype, pin_memory=True)
        host.copy_(row)
        return host

    def discard(self, saved: Any) -> None:
        """Forget a saved state that will not be loaded (its request ended while retracted)."""

    def load(self, slot: int, saved: Any) -> None:
        """Slot takes a state saved by `save` (or received from a prefill: the same bytes)."""
        if saved.numel() != self.slot_bytes:
            raise ValueError(f"a saved state of {saved.numel()} bytes does not fit a {self.slot_bytes}-byte slot")
        self.buffer[slot].copy_(saved.view(torch.uint8).reshape(-1))

    def all_free(self) -> bool:
        return not self._used
