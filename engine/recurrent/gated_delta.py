"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule, chunked for prefill, one step for decode.

Math, per value head with state S [d_k, d_v] (zeros at a sequence's start), per token t with q, k
L2-normalised (eps 1e-6, FLA's rsqrt(sum x^2 + eps)) and q scaled by d_k^-1/2:
    S <- exp(g_t) S                          g_t = -exp(A_log) * softplus(a_t + dt_bias) <= 0  (gates())
    S <- S + beta_t k_t (v_t - S^T k_t)^T    beta_t = sigmoid(b_t)
    o_t = S^T q_t
GQA-like grouping: key head h serves value heads h*r .. h*r+r-1, r = H_v / H_k (repeat_interleave).

Chunked form (prefill, chunk size 64, WY / UT representation): within a chunk, with Gamma_i the
cumulative log-decay to position i, the T = (I + tril_strict(diag(beta) K K^T * exp(Gamma_i - Gamma_j)))
system gives by one triangular solve U = T^-1 diag(beta) V and W = T^-1 diag(beta exp(Gamma)) K; then
per chunk, carrying S across chunks:
    V' = U - W S;  O = (Q exp(Gamma)) S + (Q K^T * exp(Gamma_i - Gamma_j))_causal V'
    S  <- exp(Gamma_last) S + (K exp(Gamma_last - Gamma))^T V'
The sequence is zero-padded to a multiple of 64 at its end: padded tokens have k = v = 0 and g = 0, so
they leave S exactly as it is. An initial state in and the final state out make a prompt prefilled in
engine chunks of any lengths continue exactly (up to float rounding) from one chunk to the next.
This is transformers' `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`
(models/qwen3_next) without the batch dimension, the oracle of tests/engine/test_recurrent_kernels.py.

Shapes (tokens-major, one sequence): q, k [T, H_k, d_k]; v [T, H_v, d_v]; g, beta [T, H_v]; state
[H_v, d_k, d_v] float32 (the pool keeps it fp32: the decay compounds over thousands of steps);
output [T, H_v, d_v] in v's dtype. A decode step takes [B, ...] rows and states [B, H_v, d_k, d_v].
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from engine.recurrent.segments import run_segments

CHUNK = 64


def gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor  # noqa: N803
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """in_proj's a, b [..., H_v] -> (g, beta) [..., H_v] float32, as Qwen3NextGatedDeltaNet computes them."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.float().sigmoid()


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's (and transformers') L2 normalisation over the last dim: x * rsqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _prep(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, use_qk_l2norm: bool, scale: float | None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32, q/k heads repeated to the value heads, normalised and q scaled (dim -3 is the head)."""
    hk, hv = k.shape[-2], v.shape[-2]
    if hv % hk:
        raise ValueError(f"{hv} value heads do not group over {hk} key heads")
    if hk != hv:
        q, k = q.repeat_interleave(hv // hk, dim=-2), k.repeat_interleave(hv // hk, dim=-2)
    q, k, v = q.float(), k.float(), v.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * (scale if scale is not None else q.shape[-1] ** -0.5), k, v


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, *, use_qk_l2norm: bool = True,
                           scale: float | None = None, chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's T >= 1 tokens (shapes in the module docstring) from `initial_state` (None: zeros)
    -> (o [T, H_v, d_v] in v's dtype, final state [H_v, d_k, d_v] float32)."""
    n_tok, hv, dv = v.shape
    dtype = v.dtype
    q, k, v = _prep(q, k, v, use_qk_l2norm, scale)
    dk = k.shape[-1]
    # head-major [H, T, D]; pad T to whole chunks (pad tokens: k = v = 0, g = 0 -> S unchanged)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    gt, bt = g.float().t(), beta.float().t()  # [H, T]
    pad = (-n_tok) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    gt, bt = F.pad(gt, (0, pad)), F.pad(bt, (0, pad))
    n = (n_tok + pad) // chunk_size
    q, k, v = (x.reshape(hv, n, chunk_size, -1) for x in (q, k, v))
    gt, bt = gt.reshape(hv, n, chunk_size), bt.reshape(hv, n, chunk_size)
    k_beta, v_beta = k * bt[..., None], v * bt[..., None]
    cum = gt.cumsum(-1)  # Gamma [H, n, C]
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [H, n, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its unit diagonal is implied (unitriangular)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay  # causal, the diagonal included
    q_dec = q * cum.exp()[..., None]
    k_dec = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [H, n, 1, 1]
    s = (initial_state.float() if initial_state is not None else q.new_zeros(hv, dk, dv))
    out = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + attn[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    o = out.reshape(hv, -1, dv)[:, :n_tok].transpose(0, 1)
    return o.to(dtype), s


def recurrent_gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor, *, use_qk_l2norm: bool = True,
                               scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode token for each of B sequences: q, k [B, H_k, d_k], v [B, H_v, d_v], g, beta [B, H_v],
    state [B, H_v, d_k, d_v] -> (o [B, H_v, d_v] in v's dtype, new state float32)."""
    dtype = v.dtype
    q, k, v = _prep(q, k, v, use_qk_l2norm, scale)
    s = state.float() * g.float().exp()[..., None, None]
    kv_mem = (k.unsqueeze(-2) @ s).squeeze(-2)  # S^T k [B, H, d_v]
    delta = (v - kv_mem) * beta.float()[..., None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-2) @ s).squeeze(-2).to(dtype), s


def gated_delta_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       seq_lens: Sequence[int], slots: torch.Tensor, states: torch.Tensor,
                       has_state: Sequence[bool] | None = None, *, use_qk_l2norm: bool = True,
                       scale: float | None = None, chunk_size: int = CHUNK) -> torch.Tensor:
    """A batch as the engine runs it (engine/recurrent/segments.py): per-token inputs packed
    [sum(seq_lens), ...], segment i continuing from states[slots[i]] (pool [slots, H_v, d_k, d_v],
    updated in place). One-token segments take the batched step, longer ones the chunked form.
    Returns o [sum(seq_lens), H_v, d_v] in v's dtype."""
    return run_segments(
        [q, k, v, g, beta], seq_lens, slots, states, has_state,
        step=lambda *a: recurrent_gated_delta_step(*a, use_qk_l2norm=use_qk_l2norm, scale=scale),
        chunk=lambda *a: chunk_gated_delta_rule(*a, use_qk_l2norm=use_qk_l2norm, scale=scale,
                                                chunk_size=chunk_size))
