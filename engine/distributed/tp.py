"""Tensor parallelism: which share of a layer this process holds, and the one collective the model needs.

A TP group of `size` ranks runs one model: column-parallel linears (q/k/v by head, gate/up by
intermediate) hold `split(n)` of their outputs, row-parallel ones (o, down) the matching inputs, and
their partial outputs are summed by `all_reduce`. KV heads: `kv_heads(n)`, replicated when the group
is larger than n (GQA), as the anchors do. `SINGLE` is the group of one (no communication at all).

The process-group plumbing (one process per rank, rank 0 driving the others) is tp_ranks.py and
tp_runner.py; the model only ever sees a TPGroup.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed process group of the model's collectives (None: the default one)

    @property
    def driver(self) -> bool:
        """Rank 0: the rank that schedules, samples and owns the logits."""
        return self.rank == 0

    def split(self, n: int, field: str) -> tuple[int, int]:
        """(first, count) of this rank's even share of n items; ValueError naming `field` if size does not divide n."""
        if n % self.size:
            raise ValueError(f"tensor parallel size {self.size} does not divide {field} ({n})")
        count = n // self.size
        return self.rank * count, count

    def kv_heads(self, n: int, field: str = "num_key_value_heads") -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds: an even share, or one replicated head when
        the group is larger than n (then size must be a multiple of n)."""
        if self.size <= n:
            return self.split(n, field)
        if self.size % n:
            raise ValueError(f"tensor parallel size {self.size} is not a multiple of {field} ({n})")
        return self.rank // (self.size // n), 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the group, in place; x itself when the group is one rank."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TPGroup()
