"""Reference attention over the paged KV pool in plain torch (CPU default, oracle for kernels).

FP8 KV pages (uint8 rows of codes + scale, engine/kv_fp8.py) are gathered as bytes and dequantized to
q's dtype just before SDPA: every step upcasts the keys and values it reads (measured in
docs/architecture.md, "KV cache layout")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import kv_fp8
from engine.attention.base import AttentionMetadata


def gather_kv(pages: torch.Tensor, page_ids: torch.Tensor, n: int) -> torch.Tensor:
    """pages [P, ps, H, D], page_ids [npages] -> the first n cached tokens [n, H, D] (FP8 pages: their
    packed rows [n, H, D + 4]; kv_fp8.dequantize)."""
    ps = pages.shape[1]
    need = (n + ps - 1) // ps
    # index_select, not pages[ids]: on the pool's strided per-layer view advanced indexing is ~5x slower
    return pages.index_select(0, page_ids[:need].long()).reshape(-1, pages.shape[2], pages.shape[3])[:n]


EXTEND_BLOCK = 64  # queries per SDPA call of an extend (causal_blocks)


def causal_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, window: int, scale: float,
                  gqa: bool) -> torch.Tensor:
    """q [1, Hq, L, D] at positions past..past+L-1 over k, v [1, Hkv, past+L, D]: causal attention
    (within `window` keys when > 0), EXTEND_BLOCK queries per SDPA call, each call over only the keys
    its queries can see. Why blocks: SDPA's CPU flash kernel computes every key of a block of up to
    512 keys and masks afterwards, so one causal call over a 512-token prompt does the full square's
    work; in blocks of 64 about 56% of it (a 512-token prefill's attention: 4.9 -> 3.2 ms a layer)."""
    n = q.shape[2]
    out = torch.empty_like(q)
    for s in range(0, n, EXTEND_BLOCK):
        e = min(s + EXTEND_BLOCK, n)
        lo = max(0, past + s - window + 1) if window else 0  # keys before the block's window: never seen
        pos_q = torch.arange(past + s, past + e, device=q.device)[:, None]
        pos_k = torch.arange(lo, past + e, device=q.device)[None, :]
        mask = pos_k <= pos_q  # [e - s, past + e - lo]
        if window:
            mask &= pos_k > pos_q - window
        out[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo : past + e], v[:, :, lo : past + e],
                                                         attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out


class TorchAttention:
    name = "torch"

    def forward(
        self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttentionMetadata,
        window: int = 0,
    ) -> torch.Tensor:
        hq, hkv = q.shape[1], k_pages.shape[2]
        group = hq // hkv
        if meta.max_q_len == 1:
            return self._decode(q, k_pages, v_pages, meta, group, window)
        out = torch.empty_like(q)
        start = 0
        for b, (seq_len, q_len) in enumerate(zip(meta.seq_lens_list, meta.q_lens_list)):
            # 4-D [1, H, len, D] views: with 3-D inputs SDPA falls back to its math path (about 3x
            # slower on CPU for a 512-token prefill); 4-D ones take the flash kernel, mask or not
            qb = q[start : start + q_len].unsqueeze(0).transpose(1, 2)  # [1, Hq, q_len, D]
            k = kv_fp8.dequantize(gather_kv(k_pages, meta.page_table[b], seq_len), q.dtype)
            v = kv_fp8.dequantize(gather_kv(v_pages, meta.page_table[b], seq_len), q.dtype)
            k, v = k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2)  # [1, Hkv, S, D]
            if q_len == 1 and not window:
                o = F.scaled_dot_product_attention(qb, k, v, scale=meta.scale, enable_gqa=group > 1)
            else:
                o = causal_blocks(qb, k, v, seq_len - q_len, window, meta.scale, group > 1)
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out

    @staticmethod
    def _decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, meta: AttentionMetadata,
                group: int, window: int) -> torch.Tensor:
        """All requests at once: one query each, keys gathered into a padded [B, S] block."""
        b, hq, d = q.shape
        hkv, ps = k_pages.shape[2], k_pages.shape[1]
        npages = (meta.max_seq_len + ps - 1) // ps
        ids = meta.page_table[:, :npages].reshape(-1).long()  # [B * npages]
        s = npages * ps
        row = k_pages.shape[3]  # D, or FP8's D + 4 bytes
        k = k_pages.index_select(0, ids).view(b, s, hkv, row)
        v = v_pages.index_select(0, ids).view(b, s, hkv, row)
        if kv_fp8.is_fp8(k):
            k, v = kv_fp8.dequantize(k, q.dtype), kv_fp8.dequantize(v, q.dtype)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, S, D]
        pos = torch.arange(s, device=q.device)[None, :]
        mask = pos < meta.seq_lens[:, None]  # [B, S]
        if window:
            mask &= pos >= meta.seq_lens[:, None] - window
        qg = q.view(b, hkv, group, d)  # query heads of one KV head side by side
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=meta.scale)
        return o.reshape(b, hq, d)
