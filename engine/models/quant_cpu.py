"""Fast CPU weight-only GEMMs over QuantTensor's int8 / int4 storage.

Kernels: quant_cpu.c (built once per machine by engine/native/build.py, `-O3 -march=native -fopenmp`, called
through ctypes on the tensors' memory). `gemm` computes x W^T straight from the low-bit bytes for a few
rows of x (decode); above `DENSE_ROWS` rows (prefill, large decode batches) the weight is dequantized
in one C pass into a transient fp32 buffer and multiplied by torch (a dense GEMM reuses each weight
across rows better than the GEMV-style kernel). `available()` is False where no C compiler is present
or the build fails (one log line); QuantTensor then keeps its torch dequantize path.

Why not torch's own kernels: in this torch (2.13 CPU wheel, AMD EPYC with AVX-512), both
`torch._weight_int8pack_mm` and `_weight_int4pack_mm_for_cpu` are exact (max error 2e-5 against the
dequantized fp32 weight) but slow: per SmolLM2-135M decoder layer at batch 1, one thread, int8 2.9 ms and
int4 6.2 ms against 0.28 ms for the oneDNN-packed fp32 GEMM, and 40-100x slower than fp32 at 16-64 rows
(benchmarks/quant.py's docstring has the table).

`quant.quantize(w, scheme)` (`--quantization`, in quant.py beside QuantTensor): a full-precision weight
[out, in] -> QuantTensor, weight-only: int8 symmetric per output channel (scale = max|w| / 127), int4
symmetric per group of `int4_group(in)` columns (scale = max|w| / 7 over the group, q in [-8, 7]): 128
where it divides the columns, else 64, else 32, else 16 (the kernel needs whole groups of 16; SmolLM2's
hidden size 576 is 4.5 x 128, so its 576-column weights get 64 and only down_proj's 1536 columns get
128).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path

import torch

from engine.native import build as native_build
from engine.native.build import BuildError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("quant_cpu.c")
DENSE_ROWS = 16  # above this many rows of x: dequantize in C + torch's dense GEMM (measured crossover)
SCHEMES = ("int8", "int4")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_failed: str | None = None
_p, _i32, _i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64


def _build() -> ctypes.CDLL:
    lib = native_build.load(source=SOURCE)
    lib.wq_gemm.restype = lib.wq_dequant.restype = _i32
    lib.wq_gemm.argtypes = [_p, _i64, _i64, _p, _i32, _p, _p, _i64, _i64, _p, _i32]
    lib.wq_dequant.argtypes = [_p, _i32, _p, _p, _i64, _i64, _i64, _p, _i32]
    return lib


def _get() -> ctypes.CDLL | None:
    global _lib, _failed
    with _lock:
        if _lib is None and _failed is None:
            try:
                _lib = _build()
            except BuildError as e:
                _failed = str(e)
                log.warning("quantized CPU kernels unavailable, low-bit weights dequantize in torch: %s", e)
        return _lib


def available() -> bool:
    return _get() is not None


def fits(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: str,
         group: int, cols: int) -> bool:
    """Whether `gemm`/`dequant` take this weight: CPU, fp32 x and scales (bf16/fp16 scales round the
    product in their dtype, which this fp32 kernel would not reproduce), int8/int4, whole groups of 16,
    contiguous 2-D storage."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and scale.dtype == torch.float32
            and scheme in SCHEMES and qdata.dim() == 2 and cols % group == 0 and group % 16 == 0
            and qdata.is_contiguous() and scale.is_contiguous() and (zero is None or zero.is_contiguous())
            and available())


def gemm(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: str,
         group: int, cols: int) -> torch.Tensor:
    """x [T, cols] fp32 -> x W^T [T, out] fp32 (a weight `fits` accepted)."""
    x = x.contiguous()
    rows, out = x.shape[0], qdata.shape[0]
    if rows > DENSE_ROWS:
        return torch.mm(x, dequant(qdata, scale, zero, scheme, group, cols).t())
    y = torch.empty((rows, out), dtype=torch.float32)
    rc = _get().wq_gemm(x.data_ptr(), rows, cols, qdata.data_ptr(), 8 if scheme == "int8" else 4, scale.data_ptr(),
                        None if zero is None else zero.data_ptr(), out, group, y.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"wq_gemm refused weight {(out, cols)} group {group} {scheme}")
    return y


def dequant(qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: str, group: int,
            cols: int) -> torch.Tensor:
    """The fp32 weight [out, cols], a new tensor: (q - zero) * scale, one C pass."""
    out = torch.empty((qdata.shape[0], cols), dtype=torch.float32)
    rc = _get().wq_dequant(qdata.data_ptr(), 8 if scheme == "int8" else 4, scale.data_ptr(),
                           None if zero is None else zero.data_ptr(), qdata.shape[0], cols, group, out.data_ptr(),
                           torch.get_num_threads())
    if rc:
        raise RuntimeError(f"wq_dequant refused weight {(qdata.shape[0], cols)} group {group} {scheme}")
    return out
