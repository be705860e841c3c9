"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the latent KV pool, in plain torch.

Pool layout (engine/kvcache/memory.py LatentKVPool): latent_pool[pages, layers, page_size, kv_lora_rank + rope_dim];
each cached token of a layer is one vector: the compressed latent c_kv (kv_lora_rank, after kv_a_layernorm)
followed by the rotated shared rope key k_pe (rope_dim). There is one "head": every query head reads it.

Decode (absorbed form, one query token per sequence): the caller folds W_UK into the query
(q_latent = q_nope @ W_UK, per head), so a head's score against token j is
    scale * (q_latent[h] . c_kv[j] + q_pe[h] . k_pe[j])
and its output in latent space is sum_j p_j c_kv[j]; the caller applies W_UV (then o_proj).

`mla_decode_torch` is the oracle of the Triton kernel (engine/attention/mla_triton.py, same signature).
"""

from __future__ import annotations

import torch

from engine import kv_fp8


def mla_decode_torch(q_latent: torch.Tensor, q_pe: torch.Tensor, latent_pool: torch.Tensor, layer: int,
                     page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                     kv_lora_rank: int) -> torch.Tensor:
    """Absorbed MLA decode attention, one query token per sequence (T == B, query b is sequence b's
    newest token, already written to the pool; it attends to cache positions 0..seq_lens[b]-1).

    q_latent    [T, H, kv_lora_rank]   q_nope projected into latent space by W_UK (per head)
    q_pe        [T, H, rope_dim]        rotated rope part of the query
    latent_pool [pages, layers, page_size, kv_lora_rank + rope_dim]   (c_kv | k_pe per token; FP8: uint8
                rows with 4 more bytes, the row's scale: engine/kv_fp8.py)
    layer       int, the layer of latent_pool to read
    page_table  [B, max_pages] int32, 0-padded; token i of sequence b at (page_table[b, i // ps], i % ps)
    seq_lens    [B] int32, >= 1, cached tokens including the new one
    scale       softmax scale (1/sqrt(qk_nope + qk_rope) x YaRN mscale^2)
    returns     [T, H, kv_lora_rank] in q_latent's dtype (softmax in fp32)
    """
    t, h, r = q_latent.shape
    ps = latent_pool.shape[2]
    lmax = int(seq_lens.max().item()) if t else 0
    npages = max(1, (lmax + ps - 1) // ps)
    ids = page_table[:, :npages].reshape(-1).long()  # [B * npages]
    rows = latent_pool[:, layer].index_select(0, ids).view(t, npages * ps, -1)
    kv = kv_fp8.dequantize(rows, torch.float32)  # [B, S, R + Dr] (FP8 rows: codes x their scale)
    c_kv, k_pe = kv[..., :kv_lora_rank], kv[..., kv_lora_rank:]
    scores = torch.einsum("bhr,bsr->bhs", q_latent.float(), c_kv)
    scores += torch.einsum("bhd,bsd->bhs", q_pe.float(), k_pe)
    pos = torch.arange(npages * ps, device=q_latent.device)[None, None, :]
    scores = scores.masked_fill(pos >= seq_lens.to(q_latent.device).long()[:, None, None], float("-inf"))
    p = torch.softmax(scores * scale, dim=-1)  # [B, H, S]
    return torch.einsum("bhs,bsr->bhr", p, c_kv).to(q_latent.dtype)  # [B, H, R]
