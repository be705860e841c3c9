"""What LoRA adds to a forward: the segment's adapter, the per-forward adapter map, and the batched
multi-adapter update (segmented matmul).

A forward's tokens are its segments' tokens concatenated (engine/forward/forward_batch.py); a segment
of a request with an adapter carries `Adapter(name)` in its extras, which names it in the batch's
`adapters` (the others "" = the base model). The runner turns those names into a `LoRABatch` with its
rank's registry (`LoRARegistry.batch`), which groups the rows by adapter once per forward;
every targeted linear then adds, for each adapter g of the batch, out[rows_g] += (x[rows_g] A_g^T) B_g^T
(B pre-scaled; engine/extras/lora/adapter.py). Base rows get nothing, and a batch with no adapter builds no
LoRABatch at all (ForwardContext.lora is None: the layers run exactly as without LoRA).

On CPU the batch's adapters are side by side (A_cat, B_cat, cached per adapter set) and every row is
multiplied by all of them, a 0/1 mask keeping only its own adapter's rank columns: three ops per
linear however many adapters and however their rows interleave (the extra flops, T x in x sum R, are
small next to the base GEMM at LoRA ranks). On CUDA the adapters live in per-slot
stacks (engine/extras/lora/registry.py) and one Triton SGMV launch pair (engine/extras/lora/triton_sgmv.py) covers
every adapter: the batch's runs of consecutive same-adapter rows are its segments.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tp import TPGroup
from engine.extras.lora.adapter import LoRAAdapter
from engine.models import cpu_gemm, layers


class _Inputs(Protocol):
    """The ForwardBatch fields `Adapter` fills (engine/forward/forward_batch.py)."""

    new_lens: list[int]
    adapters: list[str] | None


@dataclass(frozen=True, slots=True)
class Adapter:
    """A segment's LoRA adapter (`Segment.extras`; engine/forward/batch.py adds it for `Req.lora`)."""

    name: str

    def add(self, batch: _Inputs, seg: int, row: int) -> None:
        if batch.adapters is None:
            batch.adapters = [""] * len(batch.new_lens)
        batch.adapters[seg] = self.name


@dataclass
class ConcatWeights:
    """An adapter set's weights side by side (LoRARegistry.concat): per layer, module -> (A_cat
    [sum R, in], B_cat [out, sum R]); per module the rank width of each adapter in the set's order."""

    cat: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]
    widths: dict[str, list[int]]


@dataclass
class SlotSegments:
    """CUDA path: runs of consecutive rows under one adapter slot, as int32 device tensors [G]."""

    start: torch.Tensor
    length: torch.Tensor
    slot: torch.Tensor
    max_len: int
    stacks: dict  # (layer, module) -> (A [S, R, in], B [S, out, R]) of every slot


class LoRABatch:
    """Which rows of one forward use which adapter; `apply` adds their low-rank updates in place.

    CPU: the batch's adapters are concatenated once per adapter set (`ConcatWeights`, cached by the
    registry): A_cat [sum R_g, in], B_cat [out, sum R_g]; each linear then takes three ops whatever the
    number of adapters: v = x A_cat^T, v *= mask (token t keeps only its own adapter's rank columns;
    base rows are all zero), out += v B_cat^T."""

    def __init__(self, cat: list[dict[str, tuple[torch.Tensor, torch.Tensor]]], owner: torch.Tensor,
                 widths: dict[str, list[int]], slots: SlotSegments | None = None) -> None:
        self.cat = cat  # per layer: module -> (A_cat, B_cat)
        self.owner = owner  # int64 [T]: index of each row's adapter in the batch's set, -1 = base
        self.widths = widths  # module -> rank width of each adapter of the set (0: not targeted)
        self.masks: dict[str, torch.Tensor] = {}
        self.slots = slots

    @classmethod
    def build(cls, names: list[str], lens: list[int], adapters: dict[str, LoRAAdapter],
              device: torch.device, concat: Callable[[tuple[str, ...]], ConcatWeights],
              slot_of: dict[str, int] | None = None, stacks: dict | None = None) -> LoRABatch | None:
        """The map for segments named `names` of `lens` tokens; None when every name is "" (base).
        KeyError naming an adapter that is not loaded."""
        if not any(names):
            return None
        order = {n: i for i, n in enumerate(sorted(set(names) - {""}))}  # the set's key: order-independent
        owner: list[int] = []
        runs: list[tuple[int, int, int]] = []  # (start, length, slot)
        for name, n in zip(names, lens):
            if name and name not in adapters:
                raise KeyError(f"LoRA adapter {name!r} is not loaded")
            idx = order[name] if name else -1
            if name and slot_of is not None:
                s = slot_of[name]
                if runs and runs[-1][2] == s and runs[-1][0] + runs[-1][1] == len(owner):
                    runs[-1] = (runs[-1][0], runs[-1][1] + n, s)
                else:
                    runs.append((len(owner), n, s))
            owner.extend([idx] * n)
        slots = None
        if slot_of is not None and stacks is not None:
            t = torch.tensor(runs, dtype=torch.int32).T.contiguous().to(device)  # [3, G]
            slots = SlotSegments(t[0], t[1], t[2], max(n for _, n, _ in runs), stacks)
            return cls([], torch.empty(0), {}, slots)
        cw = concat(tuple(order))
        return cls(cw.cat, torch.tensor(owner, dtype=torch.long, device=device), cw.widths)

    def _mask(self, module: str, dtype: torch.dtype) -> torch.Tensor:
        """[T, sum R] 1 where the column belongs to the row's adapter, else 0 (built once per module)."""
        m = self.masks.get(module)
        if m is None:
            w = torch.tensor(self.widths[module], device=self.owner.device)
            col_owner = torch.repeat_interleave(torch.arange(len(w), device=w.device), w)  # [sum R]
            m = self.masks[module] = (self.owner[:, None] == col_owner[None, :]).to(dtype)
        return m

    def apply(self, layer: int, module: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out] += each row's adapter update of x [T, in] (in place; returns out)."""
        if self.slots is not None:
            from engine.extras.lora.triton_sgmv import sgmv

            pair = self.slots.stacks.get((layer, module))
            if pair is not None:
                sg = self.slots
                sgmv(x, out, pair[0], pair[1], sg.start, sg.length, sg.slot, sg.max_len)
            return out
        pair = self.cat[layer].get(module)
        if pair is None:
            return out
        a, b = pair
        v = (x @ a.T).mul_(self._mask(module, x.dtype))  # [T, sum R]
        return out.addmm_(v, b.T)  # += [T, sum R] @ [sum R, out]

    def row_parallel(self, m: nn.Linear, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup, layer: int,
                     module: str) -> torch.Tensor:
        """layers.row_parallel plus this rank's partial update (x holds this rank's input columns, A
        its matching columns), summed over the group by the same all-reduce."""
        y = layers.linear_add(m, x, residual) if tp.driver else layers.linear(m, x)
        return tp.all_reduce(self.apply(layer, module, x, y))

    def dense_mlp(self, mlp: layers.DenseMLP, x: torch.Tensor, residual: torch.Tensor, layer: int) -> torch.Tensor:
        """residual + down(silu(gate(x)) * up(x)) with the gate/up and down updates (the fused
        silu-gate GEMM is split: the update lands between the GEMM and the activation)."""
        m = mlp.gate_up_proj
        packed = getattr(m, "packed", None)  # oneDNN packs gate and up apart (a tuple)
        gu = F.linear(x, m.weight) if packed is None else \
            torch.cat([cpu_gemm.linear(x, m.weight, p) for p in packed], dim=-1)
        gu = self.apply(layer, "gate_up", x, gu)  # [T, 2 * inter]
        h = F.silu(gu[:, : mlp.inter]) * gu[:, mlp.inter :]
        return self.row_parallel(mlp.down_proj, h, residual, mlp.tp, layer, "down")
