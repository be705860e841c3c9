"""engine/native: the fused rotary + KV store against the model's torch path, and the build (cached
once per machine, a clear fallback without a compiler). Decode attention is checked against dense
float64 attention in test_torch_attention.py, and end to end by the oracle tests."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.attention.registry import create_backend
from engine.config import EngineConfig
from engine.kvcache.memory import KVPool
from engine.models.llama import RotaryTables
from engine.native import NativeKernels, build

HQ, HKV, D, PS, LAYERS = 9, 3, 64, 16, 4  # SmolLM2's heads


@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300: rows enough for the kernel's threads
def test_rope_store_matches_the_torch_path(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    native = NativeKernels.get()
    assert native is not None
    pools = [KVPool(40, LAYERS, PS, HKV, D, torch.float32, "cpu") for _ in range(2)]
    before = torch.randn(pools[0].buffer.shape, generator=g)
    for p in pools:
        p.buffer.copy_(before)
    # a qkv projection's output, rows wider than the heads (a view into a larger tensor)
    wide = torch.randn(tokens, (HQ + 2 * HKV) * D + 5, generator=g)
    qkv = wide[:, : (HQ + 2 * HKV) * D]
    angles = torch.rand(tokens, 1, D // 2, generator=g) * 100
    rot = RotaryTables(angles.cos(), angles.sin())
    slots = torch.randperm(39 * PS, generator=g)[:tokens] + PS  # distinct slots, page 0 untouched
    page, off = slots // PS, slots % PS
    layer = 2

    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    want_q = rot(q.reshape(tokens, HQ, D))
    pools[0].write(layer, page, off, rot(k.reshape(tokens, HKV, D)), v.reshape(tokens, HKV, D))
    got_q = native.rope_store(qkv, rot.cos, rot.sin, *pools[1].layer(layer), page, off, HQ, HKV, D)

    torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(pools[1].buffer, pools[0].buffer, rtol=1e-6, atol=1e-5)  # nothing else moved


def test_build_is_cached_and_atomic(tmp_path) -> None:
    first = build.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build.build(tmp_path) == first and first.stat().st_mtime_ns == mtime  # no second compile
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_without_a_compiler_the_cpu_backend_falls_back_to_torch(monkeypatch, caplog) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(NativeKernels, "_loaded", None)
    monkeypatch.setattr(NativeKernels, "_failed", None)
    with caplog.at_level(logging.WARNING, logger="engine.native"):
        backend = create_backend("cpu")
    assert backend.name == "torch"
    assert "native CPU kernels unavailable" in caplog.text and "/nonexistent/cc" in caplog.text


def test_a_failing_compile_says_why(tmp_path, monkeypatch) -> None:
    bad = tmp_path / "bad.c"
    bad.write_text("this is not C\n")
    with pytest.raises(build.BuildError, match="failed"):
        build.build(tmp_path / "out", bad)
    assert not list((tmp_path / "out").iterdir())  # the temporary object is removed


def test_auto_picks_the_native_backend_for_float32_on_cpu_only() -> None:
    assert EngineConfig().resolved_attention_backend == "cpu"
    assert EngineConfig(dtype="bfloat16").resolved_attention_backend == "torch"
    assert EngineConfig(device="cuda").resolved_attention_backend == "triton"
    with pytest.raises(ValueError, match="--attention-backend cpu runs float32 on the CPU only"):
        EngineConfig(attention_backend="cpu", dtype="bfloat16")


def test_out_of_pool_indices_raise_instead_of_reading_or_writing_past_it() -> None:
    native = NativeKernels.get()
    pool = KVPool(8, 2, PS, HKV, D, torch.float32, "cpu")
    k_pages, v_pages = pool.layer(1)
    qkv = torch.randn(2, (HQ + 2 * HKV) * D)
    cos, sin = torch.ones(2, D // 2), torch.zeros(2, D // 2)
    for page, off in ([3, 8], [0, 0]), ([3, 4], [0, PS]):  # a page past the pool; a slot past the page
        with pytest.raises(ValueError, match="outside the pool"):
            native.rope_store(qkv, cos, sin, k_pages, v_pages, torch.tensor(page), torch.tensor(off), HQ, HKV, D)
    assert torch.count_nonzero(pool.buffer) == 0  # nothing was written, not even the good token
    q = torch.randn(1, HQ, D)
    for table, seq in ([[9]], 5), ([[1]], PS + 1):  # a page past the pool; a length past the table
        with pytest.raises(ValueError, match="outside the page table or the pool"):
            native.decode_attention(q, k_pages, v_pages, torch.tensor(table, dtype=torch.int32),
                                    torch.tensor([seq], dtype=torch.int32), 0, 0.125)
