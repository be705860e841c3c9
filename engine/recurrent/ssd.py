"""Mamba2's selective state space (SSD) scan (Nemotron-H, Granite-4.0-H): chunked for prefill, one
step for decode.

Math, per head h with state H_h [head_dim P, d_state N] (zeros at a sequence's start), per token t:
    dt_t = clamp(softplus(dt_raw_t + dt_bias), dt_limit)     (softplus and dt_bias as the models use)
    H <- exp(dt_t A_h) H + dt_t x_t B_t^T                     A_h = -exp(A_log_h) < 0
    y_t = H C_t + D_h x_t                                     (the D skip; z's gate is the norm's job)
B and C come in G groups of N: head h reads group h // (H / G).

Chunked form (state space duality): within a chunk of L tokens with a_i = dt_i A the cumulative
log-decay Lambda, outputs are a masked attention Y_diag = ((C B^T) * exp(segsum(a)))  (dt x) plus the
read of the chunk's start state Y_off = exp(Lambda) C H_start; chunk-end states are propagated across
chunks by exp(segsum) of the chunk totals. The sequence is zero-padded to whole chunks at its end:
padded tokens have dt = 0 after softplus (so no decay and no input), leaving the final state exact.
This is transformers' `mamba2_chunk_scan` / `mamba2_selective_state_update` (models/mamba2; the
nemotron_h and granitemoehybrid copies are the same code) without the batch dimension, the oracle
of tests/engine/test_recurrent_kernels.py. The chunk length is the model's `chunk_size` (Nemotron-H
128, Granite 256): results do not depend on it beyond rounding.

dt_limit: transformers' chunked scan clamps dt, its one-step update does not. Both clamp here, so
prefill-then-decode equals one pass; the models we serve keep the default (0, inf), where the clamp
is the identity after softplus and both oracles agree.

Shapes (tokens-major, one sequence): x [T, H, P]; dt [T, H] before dt_bias and softplus; A, D,
dt_bias [H]; B, C [T, G, N]; state [H, P, N] float32; y [T, H, P] in x's dtype. A decode step takes
[B, ...] rows and states [B, H, P, N].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.recurrent.segments import run_segments

NO_LIMIT = (0.0, float("inf"))


def _dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool, dt_limit: tuple[float, float]
        ) -> torch.Tensor:
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    if tuple(dt_limit) != NO_LIMIT:
        dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    return dt.float()


def segsum(a: torch.Tensor) -> torch.Tensor:
    """a [..., L] -> [..., L, L]: out[i, j] = sum_{j < m <= i} a_m below and on the diagonal, -inf above
    (masked cumulative sums, as transformers' segment_sum: no differences of large cumulative sums)."""
    n = a.shape[-1]
    x = a[..., None].expand(*a.shape, n)
    strict = torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0).cumsum(dim=-2)
    return x.masked_fill(~torch.tril(torch.ones(n, n, dtype=torch.bool, device=a.device)), float("-inf"))


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
                   initial_state: torch.Tensor | None = None, *, D: torch.Tensor | None = None,  # noqa: N803
                   dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
                   dt_limit: tuple[float, float] = NO_LIMIT, chunk_size: int = 256
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T >= 1 tokens (shapes in the module docstring) from `initial_state` (None: zeros)
    -> (y [T, H, P] in x's dtype, final state [H, P, N] float32)."""
    n_tok, nh, hp = x.shape
    rep = nh // B.shape[1]
    dtype = x.dtype
    dt = _dt(dt, dt_bias, dt_softplus, dt_limit)  # [T, H]
    xf = x.float()
    Bh = B.float().repeat_interleave(rep, dim=1)  # [T, H, N]  # noqa: N806
    Ch = C.float().repeat_interleave(rep, dim=1)  # noqa: N806
    skip = D.float()[:, None] * xf if D is not None else None
    xd = xf * dt[..., None]
    a = A.float() * dt  # [T, H]
    pad = (-n_tok) % chunk_size
    n = (n_tok + pad) // chunk_size
    xd, Bh, Ch = (F.pad(t, (0, 0, 0, 0, 0, pad)).reshape(n, chunk_size, nh, -1) for t in (xd, Bh, Ch))  # noqa: N806
    a = F.pad(a, (0, 0, 0, pad)).reshape(n, chunk_size, nh).permute(2, 0, 1)  # [H, n, L]
    a_cum = a.cumsum(-1)
    # 1. within chunks: (C B^T) masked by the decays, applied to dt x
    decay = segsum(a).exp()  # [H, n, L, S]
    scores = torch.einsum("clhn,cshn->clsh", Ch, Bh) * decay.permute(1, 2, 3, 0)
    y_diag = torch.einsum("clsh,cshp->clhp", scores, xd)
    # 2. each chunk's own end state (from a zero start)
    to_end = (a_cum[..., -1:] - a_cum).exp()  # [H, n, L]
    states = torch.einsum("clhn,clhp->chpn", Bh * to_end.permute(1, 2, 0)[..., None], xd)
    # 3. chunk start states: the initial state and the chunks' own states, decayed across chunks
    start = (initial_state.float() if initial_state is not None else xd.new_zeros(nh, hp, Bh.shape[-1]))[None]
    states = torch.cat([start, states], dim=0)  # [n + 1, H, P, N]
    across = segsum(F.pad(a_cum[..., -1], (1, 0))).exp()  # [H, n + 1 (to), n + 1 (from)]
    states = torch.einsum("htz,zhpn->thpn", across, states)
    states, final = states[:-1], states[-1]
    # 4. the read of each chunk's start state
    y_off = torch.einsum("clhn,chpn->clhp", Ch, states) * a_cum.exp().permute(1, 2, 0)[..., None]
    y = (y_diag + y_off).reshape(-1, nh, hp)[:n_tok]
    if skip is not None:
        y = y + skip
    return y.to(dtype), final


def ssd_step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
             state: torch.Tensor, *, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,  # noqa: N803
             dt_softplus: bool = True, dt_limit: tuple[float, float] = NO_LIMIT) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for each of B sequences: x [B, H, P], dt [B, H], B, C [B, G, N], state
    [B, H, P, N] -> (y [B, H, P] in x's dtype, new state float32)."""
    rep = x.shape[1] // B.shape[1]
    dt = _dt(dt, dt_bias, dt_softplus, dt_limit)  # [B, H]
    xf = x.float()
    Bh = B.float().repeat_interleave(rep, dim=1)  # [B, H, N]  # noqa: N806
    Ch = C.float().repeat_interleave(rep, dim=1)  # noqa: N806
    s = state.float() * (dt * A.float()).exp()[..., None, None] + (dt[..., None] * xf)[..., None] * Bh[:, :, None, :]
    y = (s @ Ch[..., None]).squeeze(-1)
    if D is not None:
        y = y + D.float()[:, None] * xf
    return y.to(x.dtype), s


def ssd_varlen(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,  # noqa: N803
               seq_lens: Sequence[int], slots: torch.Tensor, states: torch.Tensor,
               has_state: Sequence[bool] | None = None, *, D: torch.Tensor | None = None,  # noqa: N803
               dt_bias: torch.Tensor | None = None, dt_softplus: bool = True,
               dt_limit: tuple[float, float] = NO_LIMIT, chunk_size: int = 256) -> torch.Tensor:
    """A batch as the engine runs it (engine/recurrent/segments.py): x, dt, B, C packed
    [sum(seq_lens), ...], segment i continuing from states[slots[i]] (pool [slots, H, P, N], updated in
    place). One-token segments take the batched step, longer ones the chunked scan. Returns y
    [sum(seq_lens), H, P] in x's dtype."""
    kw = {"D": D, "dt_bias": dt_bias, "dt_softplus": dt_softplus, "dt_limit": dt_limit}
    return run_segments(
        [x, dt, B, C], seq_lens, slots, states, has_state,
        step=lambda xs, dts, bs, cs, st: ssd_step(xs, dts, A, bs, cs, st, **kw),
        chunk=lambda xs, dts, bs, cs, st: ssd_chunk_scan(xs, dts, A, bs, cs, st, chunk_size=chunk_size, **kw))
