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
    shape: tuple[int, ...]  # per slot
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


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
