"""Triton MLA decode kernel vs the torch MLA oracle (interpreter on CPU, compiled on CUDA).

The latent pool has the real layout [pages, layers, page_size, kv_lora_rank + rope_dim] and the kernel
reads one layer of it (a strided view); pages are handed out shuffled so a sequence's pages are not
contiguous, and q_latent / q_pe are strided slices of one fused tensor.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.attention.mla import mla_decode_torch
from engine.attention.mla_triton import mla_decode_triton, mla_splits

LAYERS = 2
LAYER = 1


def make_case(seq_lens, heads, page_size, rank, rope, dtype, device, seed=0):
    """Random latent pool + shuffled 0-padded page tables -> kernel arguments (scale included)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [(s + page_size - 1) // page_size for s in seq_lens]
    num_pages = sum(need) + 3  # page 0 reserved, plus spare pages left unused
    pool = torch.randn((num_pages, LAYERS, page_size, rank + rope), generator=gen)
    free = list(range(1, num_pages))
    rng.shuffle(free)
    table = torch.zeros((len(seq_lens), max(need) + 1), dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
    fused = torch.randn((len(seq_lens), heads, rank + rope + 8), generator=gen).to(device=device, dtype=dtype)
    q_latent, q_pe = fused[..., :rank], fused[..., rank:rank + rope]  # strided views
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    scale = (rank // 4 + rope) ** -0.5
    return q_latent, q_pe, pool.to(device=device, dtype=dtype), LAYER, table.to(device), seq, scale, rank


def check(seq_lens, heads, page_size, device, rank=32, rope=16, dtype=torch.float32, atol=1e-4, **tune):
    args = make_case(seq_lens, heads, page_size, rank, rope, dtype, device)
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    got = mla_decode_triton(*args, **tune)
    q_latent, q_pe, pool, *rest = args
    want = mla_decode_torch(q_latent.float(), q_pe.float(), pool.float(), *rest)
    assert got.shape == (len(seq_lens), heads, rank) and got.dtype == dtype
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want, atol=atol, rtol=atol)
    return got


@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("heads", [1, 5, 16])
def test_decode_ragged(page_size, heads, device):
    # 1 token, mid-page ends, an exact page boundary, several 16-token blocks and splits
    check([1, 7, 16, 45], heads, page_size, device, block_n=16)


def test_split_counts_agree(device):
    # one split (final rows written directly), uneven splits, more splits than some sequences' blocks
    outs = [check([3, 50, 33], 4, 4, device, block_n=16, num_splits=n) for n in (1, 3, 8)]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0], outs[2], atol=1e-5, rtol=1e-5)


def test_more_heads_than_a_block(device):
    check([9, 20], 20, 4, device, block_n=16, num_splits=2)  # second head block is partial


def test_deepseek_v3_widths(device):
    # kv_lora_rank 512 + rope 64 (V3), default tiles; a width that is not a power of two as well
    check([5, 40], 3, 16, device, rank=512, rope=64, atol=2e-4)
    check([5, 18], 2, 4, device, rank=48, rope=8, num_splits=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, device):
    check([1, 30, 19], 5, 16, device, dtype=dtype, atol=2e-2, block_n=16)


def test_split_policy():
    assert mla_splits(300, 16, 4096, 32) == 1  # the grid already fills the GPU
    assert mla_splits(64, 16, 4096, 32) == 5  # cdiv(264, 64 programs)
    assert mla_splits(1, 16, 4096, 32) == 16  # one sequence: capped
    assert mla_splits(1, 16, 40, 32) == 2  # never more splits than token blocks
    assert mla_splits(4, 128, 4096, 32) == 9  # 4 x 8 head blocks -> cdiv(264, 32)


def test_bad_inputs(device):
    q_latent, q_pe, pool, layer, table, seq, scale, rank = make_case([5], 2, 4, 32, 16, torch.float32, device)
    with pytest.raises(ValueError, match="dtypes"):
        mla_decode_triton(q_latent.double(), q_pe, pool, layer, table, seq, scale, rank)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        mla_decode_triton(q_latent, q_pe, pool, layer, table, seq, scale, 16)
    with pytest.raises(ValueError, match="latent_pool"):
        mla_decode_triton(q_latent, q_pe[..., :8], pool, layer, table, seq, scale, rank)
    with pytest.raises(ValueError, match="layer"):
        mla_decode_triton(q_latent, q_pe, pool, LAYERS, table, seq, scale, rank)
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode_triton(q_latent, q_pe, pool, layer, table, seq.repeat(2), scale, rank)
    with pytest.raises(ValueError, match="block_n"):
        mla_decode_triton(q_latent, q_pe, pool, layer, table, seq, scale, rank, block_n=24)



def test_model_dispatch_follows_the_kernel_choice():
    from engine.attention.base import triton_kernels
    from engine.attention.mla import mla_decode_torch
    from engine.models.deepseek_mla import _decode_fn

    assert _decode_fn(False) is mla_decode_torch
    assert _decode_fn(True) is mla_decode_triton
    # CUDA always takes the kernels; a CPU only with the triton attention backend (the interpreter)
    assert triton_kernels("torch", "cuda") and triton_kernels("triton", "cuda:1") and triton_kernels("triton", "cpu")
    assert not triton_kernels("torch", "cpu") and not triton_kernels("cpu", "cpu")


_SM90_COMPILE = r"""
import json
from triton import compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from engine.attention import mla_triton as m

def build(fn, sig, consts, warps):
    sig = {**sig, **{k: "constexpr" for k in consts}}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts)
    return compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": 2})

sig = {"ql_ptr": "*bf16", "qpe_ptr": "*bf16", "pool_ptr": "*bf16", "page_table_ptr": "*i32",
       "seq_lens_ptr": "*i32", "mid_ptr": "*fp32", "lse_ptr": "*fp32", "qk_scale": "fp32", "num_heads": "i32",
       **{"stride_" + n: "i32" for n in "qlt qlh qld qpt qph qpd pp ps pd".split()},
       "scale_ptr": "*fp32", "stride_sp": "i32", "stride_ss": "i32",
       **{"stride_" + n: "i32" for n in "pt mb mh ms lb lh".split()}}
consts = dict(RANK=512, ROPE=64, PAGE_SIZE=16, BLOCK_H=16, BLOCK_N=32, BLOCK_R=512, BLOCK_PE=64,
              NUM_SPLITS=4, DOT_PRECISION="tf32", UPCAST=False, KV_FP8=False)
stage1 = build(m.mla_decode_stage1_kernel, sig, consts, 8)
sig = {"mid_ptr": "*fp32", "lse_ptr": "*fp32", "out_ptr": "*bf16",
       **{"stride_" + n: "i32" for n in "mb mh ms lb lh ob oh".split()}}
merge = build(m.mla_merge_kernel, sig, dict(RANK=512, BLOCK_R=512, NUM_SPLITS=5, BLOCK_S=8), 4)
print(json.dumps({"stage1_shared": stage1.metadata.shared, "merge_shared": merge.metadata.shared}))
"""


def test_compiles_for_h100_at_deepseek_v3_widths():
    """Compile both kernels for sm_90 with Triton's bundled ptxas (no GPU needed), in a fresh process: a
    process that ran the interpreter cannot also compile. Catches what the interpreter never sees:
    non-constexpr globals, unsupported ops, shared memory over an H100 SM's 227 KiB."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    root = Path(__file__).resolve().parents[3]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _SM90_COMPILE], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sizes = json.loads(proc.stdout.strip().splitlines()[-1])
    assert 0 < sizes["stage1_shared"] <= 227 * 1024
