"""How the engine calls a recurrent kernel on a batch: packed segments with state slots.

The engine's batch is a list of segments, one per request: a chunk of a prompt (any length, cut by
the prompt-chunk planner, not by the kernel's chunk size) or one decode token. Its tokens are packed
along dim 0 of every per-token input (as the attention backends get them), and each request owns one
slot of a state pool (`states` [slots, ...], per layer). `run_segments` gives each segment its state,
runs the kernel and writes the final state back to the slot, in place.

Why packed segments and not a padded batch: padding would have to leave the state unchanged through
the pad positions, which each kernel gets only with care (zero inputs AND no decay, post-softplus for
Mamba2), while per-segment calls are exact by construction; prefill cost on CPU is in the chunked
matmuls, not in the Python loop over segments. One-token segments (decode, the common case at batch
16+) are gathered into one batched recurrent step: that is where a loop would cost. A segment's
result depends only on its own length (1: the step, > 1: the chunked form), never on its neighbours.

has_state[i] False means segment i starts its sequence: it runs from a zero state and never reads the
slot, so a freshly allocated slot needs no zeroing (SGLang's and vLLM's `has_initial_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch

# step(rows of each input [B, ...], states [B, ...]) -> (y [B, ...], new states [B, ...])
Step = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# chunk(one segment's inputs [n, ...], state [...] or None) -> (y [n, ...], final state [...])
Chunk = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def run_segments(inputs: Sequence[torch.Tensor], seq_lens: Sequence[int], slots: torch.Tensor,
                 states: torch.Tensor, has_state: Sequence[bool] | None, step: Step, chunk: Chunk) -> torch.Tensor:
    """inputs: per-token tensors packed [sum(seq_lens), ...]; slots [len(seq_lens)] indices into
    `states`, one per segment, all distinct. Returns the packed outputs [sum(seq_lens), ...]."""
    total = sum(seq_lens)
    if any(t.shape[0] != total for t in inputs):
        raise ValueError(f"packed inputs have {[t.shape[0] for t in inputs]} rows, segments {total} tokens")
    if len(slots) != len(seq_lens):
        raise ValueError(f"{len(slots)} slots for {len(seq_lens)} segments")
    starts = [0, *accumulate(seq_lens)][:-1]
    dev = inputs[0].device
    out: torch.Tensor | None = None
    ones = [i for i, n in enumerate(seq_lens) if n == 1]
    if ones:
        rows = torch.tensor([starts[i] for i in ones], device=dev)
        idx = slots[ones].to(device=states.device, dtype=torch.long)
        st = states.index_select(0, idx)
        if has_state is not None and not all(has_state[i] for i in ones):
            keep = torch.tensor([bool(has_state[i]) for i in ones], device=states.device)
            st = torch.where(keep.view(-1, *[1] * (st.dim() - 1)), st, torch.zeros_like(st))
        y, new = step(*(t.index_select(0, rows) for t in inputs), st)
        out = y.new_empty(total, *y.shape[1:])
        out[rows] = y
        states.index_copy_(0, idx, new.to(states.dtype))
    for i, (s, n) in enumerate(zip(starts, seq_lens)):
        if n <= 1:
            if n < 1:
                raise ValueError(f"segment {i} has {n} tokens")
            continue
        slot = int(slots[i])
        init = states[slot] if has_state is None or has_state[i] else None
        y, new = chunk(*(t[s : s + n] for t in inputs), init)
        if out is None:
            out = y.new_empty(total, *y.shape[1:])
        out[s : s + n] = y
        states[slot] = new.to(states.dtype)
    assert out is not None, "no segments"
    return out
