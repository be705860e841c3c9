"""The MoE block (engine/models/moe.py) piece by piece: routers vs transformers' own router modules,
the CPU grouped path vs a plain per-token loop, the whole block (shared expert, TP shards) vs
transformers' SparseMoeBlock, and the Triton fused-MoE kernel under the interpreter vs the CPU path.
Whole models vs transformers: tests/engine/test_moe_families.py."""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch
import torch.nn.functional as F

from engine.config import MoESpec
from engine.distributed.tp import TPGroup
from engine.models import moe

ON_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
if not ON_CUDA:  # Triton decides interpreter vs compiler when the kernel module is imported
    _prev = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        moe_triton = importlib.reload(importlib.import_module("engine.models.moe_triton"))  # even if imported
    finally:
        if _prev is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _prev
else:
    moe_triton = importlib.import_module("engine.models.moe_triton")

H, E = 64, 8


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def dense_reference(x, weights, ids, w13, w2, inter):  # noqa: ANN001, ANN201
    """The plain per-token, per-expert loop."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (w13[e] @ x[t]).split(inter)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(g) * u))
    return out


def experts(inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * inter, H, generator=g) * 0.1, torch.randn(E, H, inter, generator=g) * 0.1


def hf_config(kind: str, **kw):  # noqa: ANN003, ANN201
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    base = dict(hidden_size=H, num_experts_per_tok=2, intermediate_size=32)
    if kind == "mixtral":
        return MixtralConfig(num_local_experts=E, **base, **kw)
    cls = Qwen2MoeConfig if kind == "qwen2_moe" else Qwen3MoeConfig
    return cls(num_experts=E, moe_intermediate_size=32, **base, **kw)


@pytest.mark.parametrize("kind,norm", [("mixtral", True), ("qwen2_moe", False), ("qwen2_moe", True),
                                       ("qwen3_moe", True), ("qwen3_moe", False)])
def test_route_matches_transformers_router(kind, norm):
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cls = {"mixtral": MixtralTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter, "qwen3_moe": Qwen3MoeTopKRouter}[kind]
    cfg = hf_config(kind) if kind == "mixtral" else hf_config(kind, norm_topk_prob=norm)
    router = cls(cfg)
    g = torch.Generator().manual_seed(1)
    router.weight.data = torch.randn(E, H, generator=g)
    x = torch.randn(50, H, generator=g)
    _, want_w, want_ids = router(x)
    got_w, got_ids = moe.route(x @ router.weight.T, 2, norm)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w.float(), rtol=1e-6, atol=1e-6)
    sums = got_w.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == norm  # renormalised exactly when asked


@pytest.mark.parametrize("tokens,top_k", [(1, 2), (5, 2), (40, 3)])
@pytest.mark.parametrize("packed", [False, True])
def test_cpu_grouped_equals_dense_loop(tokens, top_k, packed):
    inter = 24
    w13, w2 = experts(inter)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = moe.route(torch.randn(tokens, E, generator=g), top_k, True)
    want = dense_reference(x, weights, ids, w13, w2, inter)
    block = moe.SparseMoE(H, MoESpec(E, top_k, inter, True))
    block.w13.data, block.w2.data = w13.clone(), w2.clone()
    if packed:
        assert moe.pack_moe(block, "onednn") == 3 * E
        assert block.w13.numel() == 0 and block.w2.numel() == 0  # not held twice
    else:
        assert moe.pack_moe(block, "torch") == 0
    got = moe.experts_cpu(x, weights, ids, block.w13, block.w2, inter, block.packed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = torch.randn(tokens, H, generator=g)  # accumulates into `out`
    got2 = moe.experts_cpu(x, weights, ids, block.w13, block.w2, inter, block.packed, out=base.clone())
    torch.testing.assert_close(got2, base + want, rtol=1e-5, atol=1e-5)


def test_group_by_expert_is_one_stable_sort():
    ids = torch.tensor([[3, 1], [1, 0], [3, 3]])
    order, counts = moe.group_by_expert(ids, 5)
    assert counts == [1, 2, 0, 3, 0]
    assert order.tolist() == [3, 1, 2, 0, 4, 5]


class _Partial(TPGroup):
    """A TP rank whose all-reduce is the identity: its output is its own partial sum."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _block_from_hf(hf_block, spec: MoESpec, tp: TPGroup, shared: bool) -> moe.SparseMoE:  # noqa: ANN001
    sd = {k: v for k, v in hf_block.state_dict().items()}
    inter = spec.intermediate_size
    first, count = tp.split(inter, "moe_intermediate_size")
    block = moe.SparseMoE(H, spec, tp)
    gu, dn = sd["experts.gate_up_proj"], sd["experts.down_proj"]  # [E, 2I, H], [E, H, I]
    block.w13.data = torch.cat([gu[:, first:first + count], gu[:, inter + first:inter + first + count]], 1)
    block.w2.data = dn[:, :, first:first + count].contiguous()
    block.gate.weight.data = sd["gate.weight"]
    if shared:
        si = spec.shared_intermediate_size
        f, c = tp.split(si, "shared_expert_intermediate_size")
        se = block.shared_expert
        se.gate_up_proj.weight.data = torch.cat([sd["shared_expert.gate_proj.weight"][f:f + c],
                                                 sd["shared_expert.up_proj.weight"][f:f + c]])
        se.down_proj.weight.data = sd["shared_expert.down_proj.weight"][:, f:f + c].contiguous()
        block.shared_expert_gate.weight.data = sd["shared_expert_gate.weight"]
    return block


@pytest.mark.parametrize("tp_size", [1, 2])
def test_block_matches_transformers_qwen2_moe_with_shared_expert(tp_size):
    """Qwen2-MoE's block (router without renormalisation + sigmoid-gated shared expert) vs
    transformers; with tp_size 2 each rank's partial (rank 0 adding the residual) sums to the same."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    torch.manual_seed(2)
    cfg = hf_config("qwen2_moe", norm_topk_prob=False, shared_expert_intermediate_size=48)
    hf = Qwen2MoeSparseMoeBlock(cfg)
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.2)
    spec = MoESpec(E, 2, 32, False, shared_intermediate_size=48)
    x = torch.randn(1, 30, H)
    residual = torch.randn(30, H)
    with torch.no_grad():
        want = residual + hf(x)[0]
        got = sum(_block_from_hf(hf, spec, _Partial(r, tp_size), True)(x[0], residual)
                  for r in range(tp_size))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_block_refuses_uneven_tp_split():
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        moe.SparseMoE(H, MoESpec(E, 2, 30, True), TPGroup(0, 4))
    spec = dataclasses.replace(MoESpec(E, 2, 32, True), shared_intermediate_size=6)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        moe.SparseMoE(H, spec, TPGroup(0, 4))


def test_align_block_size_invariants():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, E, (13, 2), generator=g)
    ids[:, :] = ids % 5  # experts 5..7 get no tokens
    slots, block_expert = moe_triton.align_block_size(ids, E, 4)
    s = ids.numel()
    assert slots.numel() % 4 == 0 and block_expert.numel() == slots.numel() // 4
    real = slots[slots < s]
    assert sorted(real.tolist()) == list(range(s))  # every slot exactly once
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        blk = slots[4 * b:4 * b + 4]
        assert all(flat[i] == e for i in blk[blk < s].tolist())  # a block holds one expert's slots


@pytest.mark.parametrize("tokens,top_k,block_m,dtype", [
    (1, 2, 16, torch.float32), (29, 2, 16, torch.float32), (70, 3, 32, torch.float32),
    (29, 2, 16, torch.bfloat16)])
def test_triton_fused_moe_matches_cpu_path(tokens, top_k, block_m, dtype, monkeypatch):
    if not ON_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    device = "cuda" if ON_CUDA else "cpu"
    inter = 48  # not a multiple of BLOCK_N: masked columns
    w13, w2 = experts(inter, seed=tokens)
    g = torch.Generator().manual_seed(tokens + 1)
    x = torch.randn(tokens, H, generator=g)
    weights, ids = moe.route(torch.randn(tokens, E, generator=g), top_k, False)
    want = moe.experts_cpu(x, weights, ids, w13, w2, inter)
    got = moe_triton.fused_moe(x.to(device, dtype), w13.to(device, dtype), w2.to(device, dtype),
                               weights.to(device), ids.to(device), inter, block_m=block_m)
    assert got.shape == (tokens, H) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, rtol=tol, atol=tol)
