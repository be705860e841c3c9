"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2/2.5 with qkv bias, Mistral) over a paged KV pool.
Sliding-window attention (Mistral, Qwen2's upper layers) is per layer: `ModelConfig.window(layer)`.

Shapes: T = tokens of the whole batch (requests concatenated), Hq/Hkv = query/KV heads, D = head dim.
The forward writes each layer's new K/V into the pool first, then attends over the pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.memory import KVPool
from engine.models import cpu_gemm
from engine.native import NativeKernels


@dataclass
class ForwardContext:
    pool: KVPool
    backend: AttentionBackend
    meta: AttentionMetadata
    out_page: torch.Tensor  # int64 [T] page of each new token
    out_offset: torch.Tensor  # int64 [T] slot inside that page
    native: NativeKernels | None = None  # fused rotary + KV store (the cpu attention backend's kernels)


def linear(m: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """m(x), through m's oneDNN-packed weight when the loader packed one (engine/models/cpu_gemm.py)."""
    return cpu_gemm.linear(x, m.weight, getattr(m, "packed", None), m.bias)


def linear_add(m: nn.Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """residual + m(x), the add fused into the packed GEMM when there is one."""
    return cpu_gemm.linear_add(x, m.weight, getattr(m, "packed", None), residual, m.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # one fused op (fp32 inside, as HF's LlamaRMSNorm: x * rsqrt(mean(x^2) + eps) * weight)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = cfg.rope_scaling
    if not sc:
        return inv.float()
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "linear":
        return (inv / sc["factor"]).float()
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()
    if kind == "default":
        return inv.float()
    raise ValueError(f"rope_scaling type {kind!r} is not supported (linear, llama3)")


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int) -> None:
        super().__init__()
        t = torch.arange(max_pos, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(cfg))  # [max_pos, D/2]
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """cos and sin [T, 1, D/2] of the step's positions, gathered once for every layer."""
        return RotaryTables(self.cos.index_select(0, positions).unsqueeze(1),
                            self.sin.index_select(0, positions).unsqueeze(1))


@dataclass(frozen=True)
class RotaryTables:
    cos: torch.Tensor  # [T, 1, D/2] fp32
    sin: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] rotated, rotate-half convention (HF layout), computed in fp32 into one new tensor
        (4 ops: no chunk copies, no cat)."""
        x1, x2 = x.float().chunk(2, dim=-1)
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, self.cos, out=o1).addcmul_(x2, self.sin, value=-1)  # x1 cos - x2 sin
        torch.mul(x2, self.cos, out=o2).addcmul_(x1, self.sin)  # x2 cos + x1 sin
        return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.window = cfg.window(layer_id)  # sliding window in tokens, 0 = full attention
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (self.hq + 2 * self.hkv) * self.d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, rotary: RotaryTables, ctx: ForwardContext,
                residual: torch.Tensor) -> torch.Tensor:
        """residual + attention(x)."""
        t = x.shape[0]
        qkv = linear(self.qkv_proj, x)  # [T, (Hq+2Hkv)*D]
        k_pages, v_pages = ctx.pool.layer(self.layer_id)
        if ctx.native is not None:  # one call: rotate q and k, store k and v in the pool
            q = ctx.native.rope_store(qkv, rotary.cos, rotary.sin, k_pages, v_pages, ctx.out_page, ctx.out_offset,
                                      self.hq, self.hkv, self.d)
        else:
            q = self._rope_store(qkv, rotary, ctx)
        o = ctx.backend.forward(q, k_pages, v_pages, ctx.meta, self.window)  # [T, Hq, D]
        return linear_add(self.o_proj, o.reshape(t, self.hq * self.d), residual)

    def _rope_store(self, qkv: torch.Tensor, rotary: RotaryTables, ctx: ForwardContext) -> torch.Tensor:
        """The torch path of the native rope_store: rotated q [T, Hq, D]; k, v written to the pool."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = rotary(q.view(t, self.hq, self.d))  # [T, Hq, D]
        k = rotary(k.view(t, self.hkv, self.d))  # [T, Hkv, D]
        v = v.view(t, self.hkv, self.d)
        ctx.pool.write(self.layer_id, ctx.out_page, ctx.out_offset, k, v)
        return q


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.gate_up_proj.pack_parts = (self.inter, self.inter)  # packed apart: silu and * fused into them
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + down(silu(gate(x)) * up(x))."""
        m = self.gate_up_proj
        h = cpu_gemm.silu_gate_up(x, m.weight, getattr(m, "packed", None), self.inter)
        return linear_add(self.down_proj, h, residual)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rotary: RotaryTables, ctx: ForwardContext) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x), rotary, ctx, residual=x)
        return self.mlp(self.post_attention_layernorm(x), residual=x)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.rotary = Rotary(cfg, max_pos)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        rotary = self.rotary.tables(positions)
        for layer in self.layers:
            x = layer(x, rotary, ctx)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> fp32 logits [N, vocab]."""
        return cpu_gemm.linear(hidden, self.lm_head_weight(), getattr(self, "lm_packed", None)).float()

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
