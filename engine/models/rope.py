"""Rotary position embedding: inverse frequencies (default, linear, llama3, YaRN) and the cos/sin tables.

`rope_params` is the one place a `rope_scaling` dict is read: ModelConfig parsing calls it once to
refuse what this engine cannot compute exactly (ValueError naming the field), the model to build its
tables. The formulas are transformers' (`modeling_rope_utils.py`), YaRN's in the same fp32 arithmetic.
YaRN's attention factor scales cos and sin (so q.k gains its square), as transformers applies it.
"`dynamic`" (NTK) is refused: its frequencies depend on the longest sequence of the forward that
computes them, so a paged cache filled over several steps cannot reproduce it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from engine.models.rope_scaling import rope_type


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, theta: float, sc: dict) -> tuple[torch.Tensor, float]:
    """transformers' _compute_yarn_parameters, step for step in fp32."""
    factor, old = float(sc["factor"]), sc["original_max_position_embeddings"]
    attention = sc.get("attention_factor")
    if attention is None:
        mscale, mscale_all = sc.get("mscale"), sc.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else _yarn_mscale(factor))
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolation = 1 - ramp  # share of the original frequency per dimension
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def rope_params(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """(inv_freq fp32 [head_dim / 2], attention factor scaling cos/sin) for a rope_scaling dict."""
    kind = rope_type(scaling)
    d = head_dim
    if kind == "yarn":
        return _yarn(d, theta, scaling)
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    sc = scaling or {}
    if kind == "linear":
        return (inv / sc["factor"]).float(), 1.0
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (wavelen <= old / lo) & (wavelen >= old / hi)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float(), 1.0
    return inv.float(), 1.0


class Rotary(nn.Module):
    """cos/sin tables [max_pos, D/2] (fp32, times the attention factor) of every position the engine runs."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None, max_pos: int) -> None:
        super().__init__()
        # computed on the CPU even inside the loader's meta-device context: ops on meta tensors go through
        # torch's reference implementations, whose first use imports torch._dynamo (1.3 s of a worker's start)
        with torch.device("cpu"):
            inv, attention = rope_params(head_dim, theta, scaling)
            t = torch.arange(max_pos, dtype=torch.float32)
            freqs = torch.outer(t, inv)  # [max_pos, D/2]
            self.register_buffer("cos", freqs.cos() * attention, persistent=False)
            self.register_buffer("sin", freqs.sin() * attention, persistent=False)

    def tables(self, positions: torch.Tensor) -> RotaryTables:
        """cos and sin [T, 1, D/2] of the step's positions, gathered once for every layer."""
        return RotaryTables(self.cos.index_select(0, positions).unsqueeze(1),
                            self.sin.index_select(0, positions).unsqueeze(1))

    def mrope_tables(self, positions: torch.Tensor, rows: torch.Tensor) -> RotaryTables:
        """M-RoPE (Qwen2-VL and later): cos and sin [T, 1, D/2] where frequency j takes its angle from the
        position row rows[j] (0 = t, 1 = h, 2 = w) of `positions` (int64 [3, T]). The angle of one frequency
        depends only on its own position, so this is the 1-D table gathered per frequency: entry [t, j] is
        table[positions[rows[j], t], j]. `rows`: int64 [D/2] on the tables' device (`mrope_rows`)."""
        index = positions.index_select(0, rows).t()  # [T, D/2]: the position each frequency reads
        return RotaryTables(self.cos.gather(0, index).unsqueeze(1), self.sin.gather(0, index).unsqueeze(1))


def mrope_rows(half_dim: int, section: tuple[int, ...], interleaved: bool,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [half_dim]: which position row (0 = t, 1 = h, 2 = w) each rotary frequency uses. Blocks
    (Qwen2-VL, Qwen2.5-VL): the first section[0] frequencies t, the next section[1] h, the last section[2] w.
    Interleaved (Qwen3-VL): frequency j is h when j % 3 == 1 and j < 3 * section[1], w when j % 3 == 2 and
    j < 3 * section[2], else t."""
    if len(section) != 3 or sum(section) != half_dim:
        raise ValueError(f"mrope_section {list(section)} must be 3 counts summing to head_dim / 2 ({half_dim})")
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section)).to(device)
    j = torch.arange(half_dim)
    rows = torch.zeros(half_dim, dtype=torch.int64)
    for row in (1, 2):
        rows[(j % 3 == row) & (j < 3 * section[row])] = row
    return rows.to(device)


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
