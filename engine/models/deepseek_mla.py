"""DeepSeek's multi-head latent attention (MLA) layer over the latent KV pool (engine/kvcache/memory.py, latent_dim).

Per token (shapes for this rank's Hq heads; N = qk_nope_head_dim, R_ = qk_rope_head_dim, R = kv_lora_rank,
V = v_head_dim, H = hidden):

    q        = q_b(q_a_norm(q_a(x)))  or  q_proj(x)          [T, Hq, N + R_]  -> q_nope [T, Hq, N], q_pe [T, Hq, R_]
    kv_a(x)  = (c_kv, k_pe)                                  [T, R + R_]; c_kv = kv_a_norm(c_kv)
    q_pe, k_pe rotated (rope over R_ dims; interleaved pairs de-interleaved in the weights at load)
    cached   : latent = (c_kv | k_pe)                        [T, R + R_] per layer (one "head", every rank)
    kv_b     : [Hq * (N + V), R] -> per head W_UK [N, R] (keys) and W_UV [V, R] (values)

Two equal forms of the attention (scale = MLASpec.softmax_scale):
- expanded (naive): k = (c_kv W_UK^T | k_pe), v = c_kv W_UV^T per head and cached token, then ordinary
  attention of q = (q_nope | q_pe). Cost grows with the cached tokens x Hq x (N + V) x R.
- absorbed: q_latent = q_nope W_UK [T, Hq, R]; attention of (q_latent | q_pe) over the latents themselves
  (one shared key/value head, MQA); the output [T, Hq, R] times W_UV^T. Nothing per cached token is expanded.

Decode (one query per request) runs the absorbed form (engine/attention/mla.py, the Triton kernel on CUDA),
extends (prefill chunks) the form PREFILL_FORM names (measured: benchmarks/mla.py). `absorb = False` on a
layer makes its decode run the batched expanded form (the benchmark's baseline).

Tensor parallelism: q (or q_b) and kv_b by head, o_proj row-parallel; q_a, kv_a and their norms replicated,
so every rank computes and caches the same full latent (no head slicing of the pool).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine import kv_fp8
from engine.attention.mla import mla_decode_torch
from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.layers import ForwardContext, RMSNorm, RotaryTables, linear, row_parallel

PREFILL_FORM = "expanded"  # expanded | absorbed (benchmarks/mla.py measures both)
EXTEND_BLOCK = 64  # queries per SDPA call of an extend: each call sees only the keys its queries can


def _decode_fn(triton: bool):  # noqa: ANN202
    """The absorbed decode attention: the Triton kernel where the model's Triton kernels run (CUDA, or the
    triton attention backend: ForwardContext.triton), else torch."""
    if triton:
        from engine.attention.mla_triton import mla_decode_triton

        return mla_decode_triton
    return mla_decode_torch


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, scale: float) -> torch.Tensor:
    """q [1, Hq, L, D] at positions past..past+L-1, k [1, Hk, past+L, D], v [1, Hk, past+L, Dv] (Hk = Hq, or 1
    shared head) -> causal attention [1, Hq, L, Dv], EXTEND_BLOCK queries per SDPA call."""
    n = q.shape[2]
    out = q.new_empty((*q.shape[:3], v.shape[-1]))
    gqa = k.shape[1] != q.shape[1]
    for s in range(0, n, EXTEND_BLOCK):
        e = min(s + EXTEND_BLOCK, n)
        pos_q = torch.arange(past + s, past + e, device=q.device)[:, None]
        mask = torch.arange(past + e, device=q.device)[None, :] <= pos_q  # [e - s, past + e]
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, : past + e], v[:, :, : past + e],
                                                         attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out


class _LoRA:
    """`(linear, module, x)` -> linear(x), plus the batch's adapter updates of `module` in `layer` when it has any."""

    def __init__(self, batch: Any, layer: int) -> None:
        self.batch, self.layer = batch, layer

    def __call__(self, m: nn.Linear, module: str, x: torch.Tensor) -> torch.Tensor:
        y = linear(m, x)
        return y if self.batch is None else self.batch.apply(self.layer, module, x, y)


class MLAAttention(nn.Module):
    """One layer's MLA over the latent pool: forward(x, rotary, ctx, residual) -> residual + attention(x)
    (summed over the TP group). Parameters (this rank's Hq heads): q_proj, or q_a_proj + q_a_layernorm +
    q_b_proj; kv_a_proj_with_mqa, kv_a_layernorm (replicated); kv_b [Hq*(N+V), R] (a plain parameter, not
    packed: the absorbed form reads it per head; from a quantized checkpoint the loader replaces it by
    `kv_b_quant`, dequantized once per forward); o_proj."""

    QUANTIZABLE = ("kv_b",)  # parameters the loader may hold low-bit (besides nn.Linear weights)

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None
        self.layer_id, self.tp, self.m = layer_id, tp, m
        self.hq = tp.split(cfg.num_heads, "num_attention_heads")[1]
        self.hkv = 1  # the latent: one shared "head", replicated on every rank
        self.absorb = True
        qk, h = m.qk_nope_head_dim + m.qk_rope_head_dim, cfg.hidden_size
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)  # transformers' default eps for the MLA norms
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.hq * qk, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.hq * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b = nn.Parameter(torch.empty(self.hq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                                 requires_grad=False)
        self.o_proj = nn.Linear(self.hq * m.v_head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, rotary: RotaryTables, ctx: ForwardContext,
                residual: torch.Tensor) -> torch.Tensor:
        """x, residual [T, H] -> residual + attention(x) [T, H]; the new tokens' latents go to the pool first."""
        m, t = self.m, x.shape[0]
        lora = _LoRA(ctx.lora, self.layer_id)  # adapters' updates of each projection (engine/extras/lora)
        if m.q_lora_rank:
            qa = lora(self.q_a_proj, "q_a", x)
            q = lora(self.q_b_proj, "q_b", self.q_a_layernorm(qa))
        else:
            q = lora(self.q_proj, "q", x)
        q_nope, q_pe = q.view(t, self.hq, -1).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        q_pe = rotary(q_pe)  # [T, Hq, R_]
        kv = lora(self.kv_a_proj_with_mqa, "kv_a", x)  # [T, R + R_]
        latent = torch.cat([self.kv_a_layernorm(kv[:, : m.kv_lora_rank]),
                            rotary(kv[:, None, m.kv_lora_rank:])[:, 0]], dim=-1)  # [T, R + R_]
        ctx.pool.write_latent(self.layer_id, ctx.out_page, ctx.out_offset, latent)
        if ctx.meta.max_q_len == 1:
            o = self.decode(q_nope, q_pe, ctx) if self.absorb else self.decode_expanded(q_nope, q_pe, ctx)
        else:
            o = self.extend(q_nope, q_pe, ctx)
        if ctx.lora is not None:
            return ctx.lora.row_parallel(self.o_proj, o.reshape(t, self.hq * m.v_head_dim), residual, self.tp,
                                         self.layer_id, "o")
        return row_parallel(self.o_proj, o.reshape(t, self.hq * m.v_head_dim), residual, self.tp)

    def _kv_b(self) -> torch.Tensor:
        """kv_b [Hq*(N+V), R]: the parameter, or a quantized checkpoint's dequantized for this forward."""
        q = getattr(self, "kv_b_quant", None)
        return self.kv_b if q is None else q.dequant(dtype=self.kv_a_layernorm.weight.dtype)

    def _w(self, kv_b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [Hq, N, R], W_UV [Hq, V, R]) views of kv_b (given, or `_kv_b()`)."""
        w = (self._kv_b() if kv_b is None else kv_b).view(self.hq, -1, self.m.kv_lora_rank)
        return w[:, : self.m.qk_nope_head_dim], w[:, self.m.qk_nope_head_dim:]

    def decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Absorbed decode, one query per request: [T, Hq, N], [T, Hq, R_] -> [T, Hq, V]."""
        w_uk, w_uv = self._w()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, Hq, R]
        meta = ctx.meta
        attend = _decode_fn(ctx.triton or q_nope.device.type == "cuda")
        out = attend(q_lat.contiguous(), q_pe.contiguous(), ctx.pool.buffer, self.layer_id,
                     meta.page_table, meta.seq_lens, self.m.softmax_scale, self.m.kv_lora_rank)
        return torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, Hq, V]

    def decode_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The naive decode (benchmark baseline): every request's cached latents expanded by kv_b into
        per-head K and V, one padded SDPA over the batch. [T, Hq, N], [T, Hq, R_] -> [T, Hq, V]."""
        m, meta, b = self.m, ctx.meta, q_nope.shape[0]
        lat = ctx.pool.latent(self.layer_id)  # [P, ps, R + R_]
        ps = lat.shape[1]
        npages = (meta.max_seq_len + ps - 1) // ps
        s = npages * ps
        kvl = lat.index_select(0, meta.page_table[:, :npages].reshape(-1).long()).view(b, s, -1)  # [B, S, R + R_]
        kvl = kv_fp8.dequantize(kvl, q_nope.dtype)  # FP8 latents: codes x scale (a no-op otherwise)
        k, v = self._expand(kvl)  # [B, Hq, S, N + R_], [B, Hq, S, V]
        mask = torch.arange(s, device=q_nope.device)[None, :] < meta.seq_lens[:, None]  # [B, S]
        q = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(2)  # [B, Hq, 1, N + R_]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :], scale=m.softmax_scale)
        return o[:, :, 0]

    def _expand(self, kvl: torch.Tensor, kv_b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [B, S, R + R_] -> per-head K [B, Hq, S, N + R_] and V [B, Hq, S, V] (kv_b: given, or
        `_kv_b()`)."""
        m = self.m
        b, s, _ = kvl.shape
        kv_b = self._kv_b() if kv_b is None else kv_b
        kvn = F.linear(kvl[..., : m.kv_lora_rank], kv_b).view(b, s, self.hq, -1).transpose(1, 2)
        k = kvn.new_empty((b, self.hq, s, m.qk_nope_head_dim + m.qk_rope_head_dim))
        k[..., : m.qk_nope_head_dim] = kvn[..., : m.qk_nope_head_dim]
        k[..., m.qk_nope_head_dim:] = kvl[:, None, :, m.kv_lora_rank:]
        return k, kvn[..., m.qk_nope_head_dim:]

    def extend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext,
               form: str | None = None) -> torch.Tensor:
        """Causal attention of each request's new tokens over its cached latents, in `form` (default
        PREFILL_FORM; a one-token request of a mixed batch absorbed unless `absorb` is off):
        [T, Hq, N], [T, Hq, R_] -> [T, Hq, V]."""
        m, meta = self.m, ctx.meta
        form = form or PREFILL_FORM
        lat = ctx.pool.latent(self.layer_id)  # [P, ps, R + R_]
        ps = lat.shape[1]
        kv_b = self._kv_b()  # once per forward (a quantized kv_b is dequantized here)
        w_uk, w_uv = self._w(kv_b)
        out = q_nope.new_empty((q_nope.shape[0], self.hq, m.v_head_dim))
        start = 0
        for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.q_lens_list)):
            ids = meta.page_table[b, : (seq_len + ps - 1) // ps].long()
            kvl = lat.index_select(0, ids).reshape(-1, lat.shape[-1])[:seq_len]  # [S, R + R_] (FP8: + 4 bytes)
            kvl = kv_fp8.dequantize(kvl, q_nope.dtype)  # FP8 latents: codes x scale (a no-op otherwise)
            qn, qp = q_nope[start : start + q_len], q_pe[start : start + q_len]  # [L, Hq, N], [L, Hq, R_]
            if form == "absorbed" or (q_len == 1 and self.absorb):  # a decode inside a mixed batch: absorbed
                q_lat = torch.bmm(qn.transpose(0, 1), w_uk)  # [Hq, L, R]
                q = torch.cat([q_lat, qp.transpose(0, 1)], dim=-1).unsqueeze(0)  # [1, Hq, L, R + R_]
                o = causal_attend(q, kvl[None, None], kvl[None, None, :, : m.kv_lora_rank], seq_len - q_len,
                                  m.softmax_scale)[0]  # [Hq, L, R]
                o = torch.bmm(o, w_uv.transpose(1, 2))  # [Hq, L, V]
            else:
                k, v = self._expand(kvl[None], kv_b)  # [1, Hq, S, N + R_], [1, Hq, S, V]
                q = torch.cat([qn, qp], dim=-1).transpose(0, 1).unsqueeze(0)  # [1, Hq, L, N + R_]
                o = causal_attend(q, k, v, seq_len - q_len, m.softmax_scale)[0]  # [Hq, L, V]
            out[start : start + q_len] = o.transpose(0, 1)
            start += q_len
        return out
