"""Causal depthwise conv1d with a rolling state: the short convolution in front of every recurrent
layer (Gated DeltaNet over q|k|v, Mamba2 over x|B|C), kernel K = 4 in every model we serve.

Math, per channel c (depthwise: no mixing between channels), over the sequence's inputs x_t:
    y_t = act(bias_c + sum_{j=0..K-1} w[c, j] * x_{t-K+1+j}[c])
with x_t = 0 before the sequence's first token. The state after token t is the K-1 most recent inputs
x_{t-K+2..t}, oldest first: it is all a later chunk or decode step needs to continue exactly, so a
prompt prefilled in several engine chunks and then decoded equals one pass over all its tokens.

Shapes (tokens-major, as the engine's activations are): x [T, C] for one sequence or [B, C] for a
decode step; weight [C, K] (the checkpoint's conv1d.weight [C, 1, K] squeezed); bias [C] or None;
state [C, K-1] per sequence, [B, C, K-1] for a step, [slots, C, K-1] as a pool. The state's layout
(channels, then time oldest first) is the one SGLang's and vLLM's pools use, so PD can ship it as is.
Compute is in the weight's dtype (transformers does the same); activation "silu" or None.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.recurrent.segments import run_segments


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"conv1d activation {activation!r} is not one this engine runs (silu or None)")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor | None,
                  activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk of T >= 1 tokens. x [T, C], state [C, K-1] (None: a sequence's start,
    zeros) -> (y [T, C] in x's dtype, new state [C, K-1] in the weight's dtype). The new state is the
    last K-1 inputs of state|x, so a chunk shorter than K-1 keeps part of the old state."""
    c, k = weight.shape
    if state is None:
        state = x.new_zeros(c, k - 1, dtype=weight.dtype)
    xs = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=1)  # [C, K-1+T]
    y = F.conv1d(xs.unsqueeze(0), weight.unsqueeze(1), bias, groups=c)[0]  # [C, T]: no padding, state is it
    return _act(y, activation).t().to(x.dtype), xs[:, xs.shape[1] - (k - 1):].clone()


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, state: torch.Tensor,
                       activation: str | None = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for each of B sequences. x [B, C], state [B, C, K-1] -> (y [B, C], new state
    [B, C, K-1]): the state shifts left by one column and takes x as its newest."""
    xs = torch.cat([state.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)  # [B, C, K]
    y = (xs * weight).sum(-1)
    if bias is not None:
        y = y + bias
    return _act(y, activation).to(x.dtype), xs[..., 1:].clone()


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         seq_lens: Sequence[int], slots: torch.Tensor, states: torch.Tensor,
                         has_state: Sequence[bool] | None = None, activation: str | None = "silu") -> torch.Tensor:
    """A batch as the engine runs it (engine/recurrent/segments.py): x [sum(seq_lens), C] packed,
    segment i continuing the sequence whose state is states[slots[i]] (pool [slots, C, K-1], updated
    in place). Returns y [sum(seq_lens), C]."""
    return run_segments(
        [x], seq_lens, slots, states, has_state,
        step=lambda xs, st: causal_conv1d_step(xs, weight, bias, st, activation),
        chunk=lambda xs, st: causal_conv1d(xs, weight, bias, st, activation))
