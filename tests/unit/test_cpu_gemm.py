"""oneDNN-packed CPU linears (engine/models/cpu_gemm.py) against F.linear, and the packing switch.
The whole model's exactness with packing on (the default) is tests/engine/test_oracle.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engine.models import cpu_gemm


@pytest.mark.parametrize("rows", [1, 3, 16, 70])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g) * 0.1
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    got = cpu_gemm.linear(x, w, cpu_gemm.pack(w), b)
    assert got.shape == (rows, 96)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_row_buckets_bound_the_shapes_and_keep_the_rows():
    """Packed GEMMs run at bucketed row counts (oneDNN caches one primitive per shape): powers of two up to 16,
    multiples of 16 above; the caller still gets exactly its rows (70 rows ran as 80, 3 as 4)."""
    assert [cpu_gemm.bucket(n) for n in (1, 2, 3, 5, 9, 16, 17, 32, 33, 70, 512)] == \
        [1, 2, 4, 8, 16, 16, 32, 32, 48, 80, 512]
    assert len({cpu_gemm.bucket(n) for n in range(1, 513)}) == 5 + 31
    g = torch.Generator().manual_seed(0)
    w, res = torch.randn(96, 40, generator=g), torch.randn(70, 96, generator=g)
    x = torch.randn(70, 40, generator=g)
    got = cpu_gemm.linear_add(x, w, cpu_gemm.pack(w), res)
    assert got.shape == (70, 96) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w) + res, rtol=1e-5, atol=1e-5)


class _Tiny(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=True)]).to(dtype)
        self.embed = nn.Embedding(32, 8).to(dtype)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight


def test_pack_model_modes():
    m = _Tiny()
    x = torch.randn(5, 8)
    want = m.layers[1](F.silu(m.layers[0](x)))
    assert cpu_gemm.pack_model(m, "onednn") == 3
    assert all(lin.packed is not None for lin in m.layers) and m.lm_packed is not None
    assert all(lin.weight.numel() == 0 for lin in m.layers)  # not held twice
    assert m.embed.weight.shape == (32, 8)  # the embedding (here the tied head) stays
    a, b = m.layers
    got = cpu_gemm.linear(F.silu(cpu_gemm.linear(x, a.weight, a.packed)), b.weight, b.packed, b.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    plain = _Tiny()
    assert cpu_gemm.pack_model(plain, "torch") == 0
    assert all(lin.packed is None and lin.weight.numel() for lin in plain.layers) and plain.lm_packed is None
    with pytest.raises(ValueError, match="--cpu-gemm"):
        cpu_gemm.pack_model(plain, "mkl")


def test_half_precision_is_not_packed():
    m = _Tiny(torch.bfloat16)
    assert cpu_gemm.pack_model(m, "onednn") == 0
    assert m.layers[0].packed is None


@pytest.mark.parametrize("rows", [1, 16, 70])
def test_fused_residual_add_and_swiglu_equal_the_unfused_ops(rows):
    """The oneDNN post-ops (residual add; silu on the gate GEMM, times the up GEMM) against the
    separate torch ops, packed and unpacked; a `pack_parts` linear is packed as its row blocks."""
    g = torch.Generator().manual_seed(rows)
    mlp = nn.Linear(40, 2 * 24, bias=False)
    mlp.pack_parts = (24, 24)
    down = nn.Linear(24, 40, bias=True)
    with torch.no_grad():
        for w in (mlp.weight, down.weight, down.bias):
            w.copy_(torch.randn(w.shape, generator=g) * 0.2)
    x, res = torch.randn(rows, 40, generator=g), torch.randn(rows, 40, generator=g)
    gate, up = F.linear(x, mlp.weight).split(24, dim=-1)
    h_want = F.silu(gate) * up
    want = res + F.linear(h_want, down.weight, down.bias)
    for packed in (False, True):
        m = nn.Module()
        m.layers = nn.ModuleList([nn.Linear(40, 48, bias=False), nn.Linear(24, 40)])
        m.layers[0].pack_parts = (24, 24)
        m.lm_head_weight = lambda: down.weight
        m.layers.load_state_dict({"0.weight": mlp.weight, "1.weight": down.weight, "1.bias": down.bias})
        assert cpu_gemm.pack_model(m, "onednn" if packed else "torch") == (3 if packed else 0)
        a, b = m.layers
        assert isinstance(a.packed, tuple) if packed else a.packed is None
        h = cpu_gemm.silu_gate_up(x, a.weight, a.packed, 24)
        torch.testing.assert_close(h, h_want, rtol=1e-5, atol=1e-5)
        got = cpu_gemm.linear_add(h, b.weight, b.packed, res, b.bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
