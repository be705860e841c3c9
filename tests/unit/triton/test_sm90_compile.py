"""Every Triton kernel in engine/ compiled for an H100 (sm_90) with Triton's bundled ptxas, no GPU needed.

The interpreter tests (TRITON_INTERPRET=1) never run what a real compile checks: constexpr-only globals,
ops the CUDA backend lacks, shared memory, register pressure. Here each kernel is compiled exactly as its
launcher would launch it on CUDA: the real launchers run on `meta` tensors (device type not "cpu", so no
UPCAST and TF32/IEEE as on a GPU) with the kernels swapped for recorders; each recorded launch is bound
with Triton's own specialization rules for the CUDA backend (strides equal to 1 become constexprs, ints
and pointers divisible by 16 get `tt.divisibility`), then compiled. Everything runs in ONE fresh
subprocess: a process that ran the interpreter cannot also compile.

Checked per compiled kernel: shared memory <= an H100 SM's 227 KiB, and (cuobjdump's resource usage of
the cubin) no local-memory stack frame, i.e. no register spills (a Triton kernel has no other stack use).
Dtypes: bf16/fp16 as the models run, and fp32 (--dtype's default, and the GPU oracle's exact run).
Triton's metadata itself exposes `shared` (bytes), `num_warps`, `num_stages`, `tmem_size`; registers and
spills (`n_regs`, `n_spills`) only once a driver loads the cubin, hence cuobjdump.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

H100_SHARED = 227 * 1024
ROOT = Path(__file__).resolve().parents[3]


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kw)` only records the launch."""

    def __init__(self, jit, name: str, launches: list) -> None:
        self.jit, self.name, self.launches = jit, name, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.name, self.jit, args, kw))


def _patch(module, names: list[str], launches: list) -> None:
    for n in names:
        setattr(module, n, _Recorder(getattr(module, n), f"{module.__name__.split('.')[-1]}.{n}", launches))


def _attention_launches(case: str, launches: list) -> None:
    """Paged-KV attention via TritonAttention (decode stage 1/2, extend), sliding window included."""
    import torch

    from engine.attention.base import build_metadata
    from engine.attention.triton_backend import TritonAttention

    cases = {  # name: (dtype, Hq, Hkv, D, batch, seq_len, q_len, window)
        "llama8b_decode_b4": (torch.bfloat16, 32, 8, 128, 4, 1000, 1, 0),  # splits > 1: stage 1 + merge
        "llama8b_decode_b128": (torch.bfloat16, 32, 8, 128, 128, 1000, 1, 0),  # one split: writes out
        "llama8b_decode_swa": (torch.bfloat16, 32, 8, 128, 4, 9000, 1, 4096),
        "llama8b_prefill": (torch.bfloat16, 32, 8, 128, 2, 700, 500, 0),
        "llama8b_prefill_swa": (torch.bfloat16, 32, 8, 128, 2, 5000, 500, 2047),  # Phi-3: not a multiple of 16
        "qwen_d64_decode_fp16": (torch.float16, 14, 2, 64, 4, 1000, 1, 0),
        "qwen_d64_prefill_fp16": (torch.float16, 14, 2, 64, 2, 700, 500, 0),
        "fp32_decode": (torch.float32, 32, 8, 128, 4, 1000, 1, 0),  # fp32: --dtype's default
        "fp32_prefill": (torch.float32, 32, 8, 128, 2, 700, 500, 0),
        "smollm2_fp32_decode": (torch.float32, 9, 3, 64, 4, 300, 1, 0),  # benchmarks/gpu_oracle.py's shape
        "smollm2_fp32_prefill": (torch.float32, 9, 3, 64, 2, 300, 64, 0),
    }
    fp8 = case.endswith("_fp8kv")  # --kv-cache-dtype fp8_e4m3: uint8 rows of D codes + a float32 scale
    dt, hq, hkv, d, b, seq, ql, window = cases[case.removesuffix("_fp8kv")]
    ps, layers = 16, 4
    pages = -(-seq // ps)
    pool = torch.empty((b * pages + 1, layers, 2, ps, hkv, d + 4 if fp8 else d), dtype=torch.uint8 if fp8 else dt,
                       device="meta")
    tables = [list(range(1 + i * pages, 1 + (i + 1) * pages)) for i in range(b)]
    meta = build_metadata(tables, [seq] * b, [ql] * b, ps, d**-0.5, "meta")
    q = torch.empty((b * ql, hq, d), dtype=dt, device="meta")
    n = len(launches)
    TritonAttention().forward(q, pool[:, 1, 0], pool[:, 1, 1], meta, window)
    launches[n:] = [(f"{name}[{case}]", *rest) for name, *rest in launches[n:]]


def _mla_launches(launches: list) -> None:
    """DeepSeek-V3 MLA decode (512 + 64, page 16): 16 heads (TP 8) with splits, 128 heads (TP 1)."""
    import torch

    from engine.attention.mla_triton import mla_decode_triton

    for b, h, fp8 in ((4, 16, False), (64, 128, False), (4, 16, True)):  # fp8: --kv-cache-dtype fp8_e4m3 latents
        pool = torch.empty((b * 256 + 1, 2, 16, 580 if fp8 else 576), dtype=torch.uint8 if fp8 else torch.bfloat16,
                           device="meta")
        fused = torch.empty((b, h, 576), dtype=torch.bfloat16, device="meta")
        table = torch.empty((b, 256), dtype=torch.int32, device="meta")
        seq = torch.empty((b,), dtype=torch.int32, device="meta")
        n = len(launches)
        mla_decode_triton(fused[..., :512], fused[..., 512:], pool, 1, table, seq, 0.07, 512)
        launches[n:] = [(f"{name}[b{b}h{h}{'_fp8kv' if fp8 else ''}]", *rest) for name, *rest in launches[n:]]


def _moe_launches(launches: list) -> None:
    """Fused MoE (hidden 2048, intermediate 768, 64 experts, top 8): decode (BLOCK_M 16), prefill (64)."""
    import torch

    from engine.models import moe_triton

    h, inter, e, k = 2048, 768, 64, 8
    w13 = torch.empty((e, 2 * inter, h), dtype=torch.bfloat16, device="meta")
    w2 = torch.empty((e, h, inter), dtype=torch.bfloat16, device="meta")
    for t in (64, 4096):
        s = t * k
        bm = moe_triton._block_m(s, e)
        total = -(-(s + e * (bm - 1)) // bm) * bm
        slots = torch.empty((total,), dtype=torch.int64, device="meta")
        block_expert = torch.empty((total // bm,), dtype=torch.int64, device="meta")
        weight = torch.empty((s,), dtype=torch.float32, device="meta")
        x = torch.empty((t, h), dtype=torch.bfloat16, device="meta")
        mid = torch.empty((s, inter), dtype=torch.bfloat16, device="meta")
        y = torch.empty((s, h), dtype=torch.bfloat16, device="meta")
        n = len(launches)
        moe_triton._gemm(x, w13, mid, slots, block_expert, weight, k, True, bm)
        moe_triton._gemm(mid, w2, y, slots, block_expert, weight, 1, False, bm)
        launches[n:] = [(f"{name}[{'gated' if i == 0 else 'down'},T{t},BM{bm}]", *rest)
                        for i, (name, *rest) in enumerate(launches[n:])]


def _lora_launches(launches: list) -> None:
    """LoRA SGMV shrink + expand (bf16, hidden 4096): qkv at --max-lora-rank 8 (rank width 3 x 8 = 24, not
    a multiple of 16) and down (14336 -> 4096) at rank 16; 3 segments over 64 rows."""
    import torch

    from engine.extras.lora.triton_sgmv import sgmv

    for name, k, n, r in (("qkv", 4096, 6144, 24), ("down", 14336, 4096, 16)):
        x = torch.empty((64, k), dtype=torch.bfloat16, device="meta")
        out = torch.empty((64, n), dtype=torch.bfloat16, device="meta")
        a = torch.empty((4, r, k), dtype=torch.bfloat16, device="meta")
        b = torch.empty((4, n, r), dtype=torch.bfloat16, device="meta")
        seg = [torch.empty((3,), dtype=torch.int32, device="meta") for _ in range(3)]
        i = len(launches)
        sgmv(x, out, a, b, *seg, max_len=40)
        launches[i:] = [(f"{kname}[{name},R{r}]", *rest) for kname, *rest in launches[i:]]


def _recurrent_launches(launches: list) -> None:
    """The hybrid models' decode steps (engine/recurrent/triton_steps.py), bf16 inputs and fp32 state pools:
    Qwen3-Next's conv1d (8192 channels, kernel 4) and Gated DeltaNet (16 key heads x 128, 32 value heads
    x 128), Nemotron-H's Mamba2 SSD (128 heads x 64, 8 groups, state 128); batch 64, slots 80."""
    import torch

    from engine.recurrent import triton_steps as ts

    def t(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device="meta")

    b, slots = 64, torch.empty((64,), dtype=torch.int64, device="meta")
    n = len(launches)
    ts.conv1d_decode_step(t(b, 8192), t(8192, 4), t(8192), slots, t(80, 8192, 3, dtype=torch.float32))
    ts.gdn_decode_step(t(b, 16, 128), t(b, 16, 128), t(b, 32, 128), t(b, 32, dtype=torch.float32),
                       t(b, 32, dtype=torch.float32), slots, t(80, 32, 128, 128, dtype=torch.float32))
    f32 = torch.float32
    ts.ssd_decode_step(t(b, 128, 64), t(b, 128, dtype=f32), t(128, dtype=f32), t(b, 8, 128), t(b, 8, 128), slots,
                       t(80, 128, 64, 128, dtype=f32), D=t(128, dtype=f32), dt_bias=t(128, dtype=f32))
    launches[n:] = [(f"{name}[b{b}]", *rest) for name, *rest in launches[n:]]
    # the chunked prefill kernels (engine/recurrent/triton_chunked.py): a packed batch of 3 prompt chunks
    from engine.recurrent import triton_chunked as tc

    lens, slots3, has = [300, 64, 1], torch.empty((3,), dtype=torch.int64, device="meta"), [False, True, True]
    total = sum(lens)
    n = len(launches)
    tc.conv1d_prefill(t(total, 8192), t(8192, 4), t(8192), lens, slots3, t(80, 8192, 3, dtype=f32), has)
    tc.gdn_prefill(t(total, 16, 128), t(total, 16, 128), t(total, 32, 128), t(total, 32, dtype=f32),
                   t(total, 32, dtype=f32), lens, slots3, t(80, 32, 128, 128, dtype=f32), has)
    tc.ssd_prefill(t(total, 128, 64), t(total, 128, dtype=f32), t(128, dtype=f32), t(total, 8, 128), t(total, 8, 128),
                   lens, slots3, t(80, 128, 64, 128, dtype=f32), has, D=t(128, dtype=f32), dt_bias=t(128, dtype=f32))
    launches[n:] = [(f"{name}[prefill]", *rest) for name, *rest in launches[n:]]


def _record_all() -> list:
    from engine.attention import mla_triton, triton_kernels
    from engine.extras.lora import triton_sgmv
    from engine.models import moe_triton
    from engine.recurrent import triton_chunked, triton_steps

    launches: list = []
    _patch(triton_kernels, ["decode_stage1_kernel", "decode_stage2_kernel", "extend_kernel"], launches)
    _patch(mla_triton, ["mla_decode_stage1_kernel", "mla_merge_kernel"], launches)
    _patch(moe_triton, ["moe_gemm_kernel"], launches)
    _patch(triton_sgmv, ["sgmv_shrink_kernel", "sgmv_expand_kernel"], launches)
    _patch(triton_steps, ["conv1d_step_kernel", "gdn_step_kernel", "ssd_step_kernel"], launches)
    _patch(triton_chunked, ["conv1d_varlen_kernel", "gdn_chunked_kernel", "ssd_cb_kernel", "ssd_chunked_kernel"],
           launches)
    for case in ("llama8b_decode_b4", "llama8b_decode_b128", "llama8b_decode_swa", "llama8b_prefill",
                 "llama8b_prefill_swa", "qwen_d64_decode_fp16", "qwen_d64_prefill_fp16", "fp32_decode",
                 "fp32_prefill", "smollm2_fp32_decode", "smollm2_fp32_prefill", "llama8b_decode_b4_fp8kv",
                 "llama8b_prefill_fp8kv", "fp32_decode_fp8kv"):
        _attention_launches(case, launches)
    _mla_launches(launches)
    _moe_launches(launches)
    _lora_launches(launches)
    _recurrent_launches(launches)
    return launches


def _resources(cubin: bytes) -> dict:
    """REG / STACK / LOCAL of the cubin's kernel, from Triton's bundled cuobjdump."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    return {k.lower(): int(v) for k, v in re.findall(r"\b(REG|STACK|LOCAL):(\d+)", out)}


def main() -> None:
    """Compile every recorded launch for sm_90; print one JSON line {launch: report}."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile, make_backend

    try:  # Triton's launch-time binder (internal): the specialization exactly as a launch computes it
        from triton.runtime.jit import create_function_from_signature
    except ImportError as e:
        raise SystemExit(f"SKIP: this Triton has no create_function_from_signature ({e})") from e

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    report: dict = {}
    for name, jit, args, kw in _record_all():
        binder = create_function_from_signature(jit.signature, jit.params, backend)
        bound, spec, opts = binder(*args, **kw)
        options, signature, constexprs, attrs = jit._pack_args(backend, kw, bound, spec, opts)
        t0 = time.perf_counter()
        try:
            ck = compile(ASTSource(jit, signature, constexprs, attrs), target=target, options=options.__dict__)
        except Exception as e:  # noqa: BLE001 - reported per kernel, the test names it
            report[name] = {"error": f"{type(e).__name__}: {str(e)[-1500:]}"}
            continue
        report[name] = {"shared": ck.metadata.shared, "num_warps": ck.metadata.num_warps,
                        "num_stages": ck.metadata.num_stages, **_resources(ck.asm["cubin"]),
                        "seconds": round(time.perf_counter() - t0, 2)}
    print(json.dumps(report))


def _engine_kernels() -> set[str]:
    """Public `@triton.jit` functions under engine/ (helpers called from kernels start with "_")."""
    found = set()
    for path in (ROOT / "engine").rglob("*.py"):
        found |= set(re.findall(r"@triton\.jit[^\n]*\ndef ([A-Za-z]\w*)", path.read_text()))
    return found


# compiled (no error, shared memory fits) but known to spill, and so never launched on CUDA by default
# (engine/recurrent/batch.py: GDN_CHUNKED_ON_CUDA is False; checked below)
SPILLS_NOT_ON_CUDA = {"gdn_chunked_kernel"}


def test_every_kernel_compiles_for_h100() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("this Triton install has no ptxas")
    if proc.returncode and "SKIP: " in proc.stderr:
        pytest.skip(proc.stderr.split("SKIP: ", 1)[1].strip())
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(report, indent=1))  # shown with -s: shared / registers / stack per launch
    compiled = {name.split("[")[0].split(".")[-1] for name in report}
    assert _engine_kernels() <= compiled, f"kernels not compiled here: {_engine_kernels() - compiled}"
    errors = {k: r["error"] for k, r in report.items() if "error" in r}
    assert not errors, errors
    for name, r in report.items():
        assert 0 <= r["shared"] <= H100_SHARED, (name, r)
        if name.split("[")[0].split(".")[-1] in SPILLS_NOT_ON_CUDA:
            continue
        assert r["stack"] == 0 and r["local"] == 0, f"{name} spills registers: {r}"
    from engine.recurrent import batch

    assert not batch.GDN_CHUNKED_ON_CUDA, "a kernel that spills is taken on CUDA"


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
