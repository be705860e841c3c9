"""The layers every family shares, tensor-parallel by construction (engine/distributed/tp.py's TPGroup).

Shapes: T = tokens of the whole batch (requests concatenated), Hq/Hkv = this rank's query/KV heads,
D = head dim, H = hidden size. The forward writes each layer's new K/V into the pool first, then
attends over the pool. Sliding-window attention is per layer: `ModelConfig.window(layer)`.

Sharding (SINGLE = one rank holding everything): q/k/v column-parallel by head (`tp.split(num_heads)`
query heads, `tp.kv_heads(num_kv_heads)` KV heads, replicated when the group outnumbers them), o
row-parallel; gate/up column-parallel by intermediate, down row-parallel. A row-parallel layer's
output is `row_parallel`: rank 0 adds the residual (and the layer's bias) inside its GEMM, the other
ranks only their partial product, then one all-reduce sums them. The embedding is replicated; the LM
head lives on rank 0 only (the driver, the only rank that calls `logits`).

A family builds `CausalLM(cfg, max_pos, tp, mlp)` where `mlp(cfg, layer_id, tp)` makes each layer's
MLP block: a module whose forward(x, residual) returns residual + block(x), summed over the group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.kvcache.memory import KVPool
from engine.models import cpu_gemm
from engine.models.rope import Rotary, RotaryTables
from engine.native import NativeKernels

__all__ = ["CausalLM", "DenseMLP", "Attention", "DecoderLayer", "ForwardContext", "RMSNorm", "Rotary",
           "RotaryTables", "linear", "linear_add", "row_parallel"]


@dataclass
class ForwardContext:
    pool: KVPool
    backend: AttentionBackend
    meta: AttentionMetadata
    out_page: torch.Tensor  # int64 [T] page of each new token
    out_offset: torch.Tensor  # int64 [T] slot inside that page
    native: NativeKernels | None = None  # fused rotary + KV store (the cpu attention backend's kernels)
    lora: Any = None  # engine.extras.lora.batch.LoRABatch when a segment runs under an adapter, else None
    state: Any = None  # engine.recurrent.batch.StateBatch of a hybrid model's forward (slots per segment), else None
    triton: bool = False  # the model's own Triton kernels run (engine.attention.base.triton_kernels): MLA decode


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding without its random init (the loader fills every weight). Built on the meta device,
    the init's normal_ goes through torch's reference ops, whose first use imports torch._dynamo: 1.7 s
    of every worker's start-up, measured."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """m(x), through m's oneDNN-packed weight when the loader packed one (engine/models/cpu_gemm.py), or
    its low-bit weight (`weight_quant`, a quantized checkpoint's: engine/models/quant.py) dequantized
    for this call."""
    q = getattr(m, "weight_quant", None)
    if q is not None:
        return q.linear(x, m.bias)
    return cpu_gemm.linear(x, m.weight, getattr(m, "packed", None), m.bias)


def linear_add(m: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + m(x), the add fused into the packed GEMM when there is one."""
    q = getattr(m, "weight_quant", None)
    if q is not None:
        return q.linear(x, m.bias).add_(residual)
    return cpu_gemm.linear_add(x, m.weight, getattr(m, "packed", None), residual, m.bias)


def row_parallel(m: nn.Linear, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """residual + m(x) for a row-parallel m (this rank holds x's columns [T, in/size]): rank 0 computes
    residual + x W_0^T (+ bias, which only rank 0 holds), the others x W_r^T; one all-reduce sums them."""
    return tp.all_reduce(linear_add(m, x, residual) if tp.driver else linear(m, x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op (fp32 inside, as HF's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class Attention(nn.Module):
    """Self-attention over the paged pool: this rank's heads (`hq` query, `hkv` KV), q/k RMSNorm per head
    before rope when cfg.qk_norm (Qwen3)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        self.kv_layer = cfg.kv_index(layer_id)  # its index in the KV pool (a hybrid model skips its recurrent layers)
        self.window = cfg.window(layer_id)  # sliding window in tokens, 0 = full attention
        self.hq = tp.split(cfg.num_heads, "num_attention_heads")[1]
        self.hkv = tp.kv_heads(cfg.num_kv_heads)[1]
        self.d = d = cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.hq * d, cfg.hidden_size, bias=cfg.o_bias and tp.driver)
        self.q_norm = RMSNorm(d, cfg.rms_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, rotary: RotaryTables, ctx: ForwardContext,
                residual: torch.Tensor) -> torch.Tensor:
        """x, residual [T, H] -> residual + attention(x) [T, H] (summed over the group)."""
        t = x.shape[0]
        qkv = linear(self.qkv_proj, x)  # [T, (Hq+2Hkv)*D]
        if ctx.lora is not None:  # each adapter's rows += x A^T B^T (engine/extras/lora)
            ctx.lora.apply(self.layer_id, "qkv", x, qkv)
        if self.q_norm is not None:  # in place, per head: q heads then k heads
            heads = qkv.view(t, self.hq + 2 * self.hkv, self.d)
            heads[:, : self.hq] = self.q_norm(heads[:, : self.hq])
            heads[:, self.hq : self.hq + self.hkv] = self.k_norm(heads[:, self.hq : self.hq + self.hkv])
        k_pages, v_pages = ctx.pool.layer(self.kv_layer)
        if ctx.native is not None:  # one call: rotate q and k, store k and v in the pool
            q = ctx.native.rope_store(qkv, rotary.cos, rotary.sin, k_pages, v_pages, ctx.out_page, ctx.out_offset,
                                      self.hq, self.hkv, self.d)
        else:
            q = self._rope_store(qkv, rotary, ctx)
        o = ctx.backend.forward(q, k_pages, v_pages, ctx.meta, self.window)  # [T, Hq, D]
        if ctx.lora is not None:
            return ctx.lora.row_parallel(self.o_proj, o.reshape(t, self.hq * self.d), residual, self.tp,
                                         self.layer_id, "o")
        return row_parallel(self.o_proj, o.reshape(t, self.hq * self.d), residual, self.tp)

    def _rope_store(self, qkv: torch.Tensor, rotary: RotaryTables, ctx: ForwardContext) -> torch.Tensor:
        """The torch path of the native rope_store: rotated q [T, Hq, D]; k, v written to the pool."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = rotary(q.view(t, self.hq, self.d))  # [T, Hq, D]
        k = rotary(k.view(t, self.hkv, self.d))  # [T, Hkv, D]
        v = v.view(t, self.hkv, self.d)
        ctx.pool.write(self.kv_layer, ctx.out_page, ctx.out_offset, k, v)
        return q


class DenseMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), this rank's `inter` share of the intermediate (`field` names
    the config field TP must divide: intermediate_size, or an MoE's shared expert size)."""

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup = SINGLE,
                 field: str = "intermediate_size") -> None:
        super().__init__()
        self.tp = tp
        self.inter = inter = tp.split(intermediate, field)[1]
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.gate_up_proj.pack_parts = (inter, inter)  # packed apart: silu and * fused into them
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> silu(gate(x)) * up(x) [T, inter] (this rank's share)."""
        m = self.gate_up_proj
        q = getattr(m, "weight_quant", None)
        if q is not None:  # low-bit gate/up (engine/models/quant.py): one GEMM, then silu(gate) * up
            gate, up = q.linear(x).split(self.inter, dim=-1)
            return F.silu(gate).mul_(up)
        return cpu_gemm.silu_gate_up(x, m.weight, getattr(m, "packed", None), self.inter)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """x, residual [T, H] -> residual + down(silu(gate(x)) * up(x)) (summed over the group)."""
        return row_parallel(self.down_proj, self.act(x), residual, self.tp)


MLPFactory = Callable[[ModelConfig, int, TPGroup], nn.Module]


def dense_mlp(cfg: ModelConfig, layer_id: int, tp: TPGroup) -> nn.Module:
    """The dense families' MLP block for every layer."""
    return DenseMLP(cfg.hidden_size, cfg.intermediate_size, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rotary: RotaryTables, ctx: ForwardContext) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), rotary, ctx, residual=x)
        if ctx.lora is not None and isinstance(self.mlp, DenseMLP):
            return ctx.lora.dense_mlp(self.mlp, self.post_attention_layernorm(x), x, self.self_attn.layer_id)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class CausalLM(nn.Module):
    """Embedding -> decoder layers -> final norm; `logits` on rank 0 (the driver) only. Parameter names:
    embed_tokens, layers.N.{input_layernorm, self_attn.{qkv_proj, o_proj, q_norm, k_norm},
    post_attention_layernorm, mlp.*}, norm, lm_head (untied, rank 0 only)."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE, mlp: MLPFactory = dense_mlp) -> None:
        super().__init__()
        self.cfg, self.tp = cfg, tp
        tp.split(cfg.num_heads, "num_attention_heads")  # heads first: the error names the first misfit
        tp.kv_heads(cfg.num_kv_heads)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, mlp(cfg, i, tp)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_pos)
        untied_head = not cfg.tie_embeddings and tp.driver
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if untied_head else None

    @property
    def local_heads(self) -> int:
        """Query heads this rank computes."""
        return self.layers[0].self_attn.hq

    @property
    def local_kv_heads(self) -> int:
        """KV heads this rank computes and keeps in its pool."""
        return self.layers[0].self_attn.hkv

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final hidden states [T, H] (the same on every rank).
        input_embeds [T, H]: the input rows instead of the ids' embeddings (engine.extras.features)."""
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        rotary = self.rotary.tables(positions)
        for layer in self.layers:
            x = layer(x, rotary, ctx)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, vocab]; rank 0 only."""
        if not self.tp.driver:
            raise RuntimeError("logits are computed on tensor-parallel rank 0 only")
        return cpu_gemm.linear(hidden, self.lm_head_weight(), getattr(self, "lm_packed", None)).float()

    def lm_head_weight(self) -> torch.Tensor | None:
        """The output head's weight [vocab, H] (the embedding when tied); None on ranks other than 0."""
        if not self.tp.driver:
            return None
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
