"""Quantized checkpoints as they ship: config.json's `quantization_config`, the weights kept low-bit.

Supported (`parse`; anything else is a ValueError naming `quantization_config.<field>`):
- block FP8 (`quant_method: fp8`: DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8): a weight `X.weight` in
  float8_e4m3fn with a sibling `X.weight_scale_inv` fp32 [ceil(out/bo), ceil(in/bi)] for
  `weight_block_size` [bo, bi]; w = fp8 * scale per block. `activation_scheme` must be dynamic (the
  activations are not quantized here: the CPU computes in the model's dtype), `fmt` e4m3.
- compressed-tensors (`quant_method: compressed-tensors`, `format: pack-quantized`): int4 / int8
  weight-only config groups (group or channel scales, symmetric or with `weight_zero_point`);
  `X.weight_packed` int32, `X.weight_scale`, `X.weight_shape`; activation quantization, actorder,
  a kv_cache_scheme, other formats and types are refused. Its `ignore` list needs no matching here:
  an ignored module ships a plain `weight`, loaded as it is.
A weight the checkpoint ships unquantized stays so (the MoE router, norms, embeddings, the LM head).

In memory (`QuantTensor`): the values as shipped (fp8 bytes; int8 or two int4 per byte, the int32
words' own bytes) and their scales with one entry per (row, column group): FP8's 128x128 block scales
are expanded along the rows only, [*, out, ceil(in/bi)], so row slices, concatenations (q/k/v and
gate/up fused), expert stacks and row permutations (DeepSeek's rope de-interleave) are one operation
on the values and the scales alike, whatever the 128-row block boundaries (DeepSeek-V3's
kv_a_proj_with_mqa has 576 rows: 4.5 blocks). Cost of that choice: 4 bytes per `bi` weights, 3% over
the fp8 bytes at bi = 128 (1.03 bytes per weight against fp32's 4: 0.258 of fp32).

Compute (`QuantTensor.linear`): int8 / int4 weights with fp32 scales, fp32 activations on the CPU run
through quant_cpu.py's C kernel straight from the stored bytes (decode: up to 16 rows; above that a
one-pass C dequantize into a transient fp32 weight and a dense GEMM); the GEMM sums (q - zero) x per group
and scales once per group, equal to the dequantize path within float rounding. torch's own weight-only
CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) are exact but 10-20x slower than
packed fp32 here (quant_cpu.py has the numbers). Everything else (fp8; bf16/fp16 scales, whose product
compressed-tensors rounds in that dtype; bf16 activations; expert stacks through `dequant`) dequantizes
one whole layer (or one expert, or MLA's kv_b once per forward) per call into a transient buffer freed
after the GEMM (torch's F.linear); no full-precision copy of the model is kept. Per layer rather than
block by block: row tiles of 64..512 rows through torch ops measured slower (per-op overhead beats the
cache gain at these sizes). FP8 -> fp32 goes through integer bit moves (`fp8_bits_to_fp32`, about 30x
faster than torch's own cast on this CPU) and is bit-identical to transformers' `FineGrainedFP8Config(
dequantize=True)`; ints follow compressed-tensors' (q - zero) * scale in the scale's dtype. The dequantize
path costs a few passes over out*in values per call: slower than the packed fp32 GEMM (per layer at
SmolLM2-135M's shapes, one thread, batch 1: fp8 about 4x, int8 about 3x, int4 about 6x the packed fp32 time).

Why FP8 is not converted at load to int8 per channel (which the fast kernel would run): e4m3 holds 3
mantissa bits over a 2^-9..448 range, so one scale per row cannot hold every fp8 value of a 128x128 block
exactly in 8 bits (and two blocks' scales differ along a row); the converted weights would differ from
what transformers computes with FineGrainedFP8Config(dequantize=True), and the FP8 oracle tests require
1e-3 on the logits and identical greedy tokens. An FP8 fast path needs a kernel that reads e4m3 bytes and
block scales (issue 49's remaining part). Tensor parallelism over quantized weights is refused at load
(`loader.load_model`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import quant_cpu

FP8_FIELDS = {"quant_method", "weight_block_size", "activation_scheme", "fmt", "modules_to_not_convert",
              "ignored_layers"}
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_packed", "weight_zero_point", "weight_shape",
                  "input_scale", "weight_g_idx")


CT_FIELDS = {"quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
             "global_compression_ratio", "sparsity_config", "transform_config", "version", "quant_cfg"}
CT_WEIGHT_FIELDS = {"num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "actorder", "observer",
                    "observer_kwargs", "block_structure", "zp_dtype", "scale_dtype"}


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's weight quantization, parsed from config.json's `quantization_config`."""

    method: str  # "fp8" | "compressed-tensors"
    block: tuple[int, int] = (0, 0)  # fp8 weight_block_size [rows, columns]
    bits: tuple[int, ...] = ()  # compressed-tensors: the num_bits its config groups use (4 and/or 8)
    ignore: tuple[str, ...] = ()  # compressed-tensors' ignore list (those modules ship unquantized)

    def describe(self) -> str:
        if self.method == "fp8":
            return f"block FP8 e4m3 {self.block[0]}x{self.block[1]}"
        return f"compressed-tensors pack-quantized int{'/int'.join(map(str, self.bits))} weight-only"


def parse(raw_config: Mapping) -> QuantScheme | None:
    """config.json's `quantization_config` -> QuantScheme (None when the checkpoint is not quantized). A
    scheme or field this engine cannot load exactly is a ValueError naming `quantization_config.<field>`."""
    qc = raw_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"config.json field 'quantization_config' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    if method != "fp8":
        raise ValueError(f"config.json field 'quantization_config.quant_method' ({method!r}) is not supported; "
                         "this engine loads: fp8 (block FP8, weight_block_size), compressed-tensors "
                         "(pack-quantized int4/int8 weight-only)")
    extra = sorted(set(qc) - FP8_FIELDS)
    if extra:
        raise ValueError(f"config.json field 'quantization_config.{extra[0]}' is not supported for quant_method fp8 "
                         f"(known: {', '.join(sorted(FP8_FIELDS))})")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ValueError(f"config.json field 'quantization_config.weight_block_size' must be two positive integers "
                         f"(per-tensor FP8 is not supported), got {block!r}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"config.json field 'quantization_config.activation_scheme' "
                         f"({qc['activation_scheme']!r}) is not supported (dynamic only)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"config.json field 'quantization_config.fmt' ({qc['fmt']!r}) is not supported (e4m3 only)")
    return QuantScheme("fp8", (block[0], block[1]))


def _parse_compressed_tensors(qc: Mapping) -> QuantScheme:
    """compressed-tensors: `pack-quantized` int4/int8 weight-only config groups (group or channel scales,
    symmetric or not); anything else refused naming its field."""
    field = "config.json field 'quantization_config."
    extra = sorted(set(qc) - CT_FIELDS)
    if extra:
        raise ValueError(f"{field}{extra[0]}' is not supported for quant_method compressed-tensors")
    if qc.get("format") != "pack-quantized":
        raise ValueError(f"{field}format' ({qc.get('format')!r}) is not supported (pack-quantized only)")
    if qc.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"{field}quantization_status' ({qc['quantization_status']!r}) is not supported "
                         "(compressed only)")
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise ValueError(f"{field}{key}' is not supported")
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{field}config_groups' must be a non-empty object, got {groups!r}")
    bits = set()
    for gname, g in groups.items():
        at = f"{field}config_groups.{gname}"
        if not isinstance(g, Mapping):
            raise ValueError(f"{at}' must be an object")
        for key in ("input_activations", "output_activations"):
            if g.get(key):
                raise ValueError(f"{at}.{key}' is not supported (weight-only quantization only)")
        if g.get("format", "pack-quantized") not in ("pack-quantized", None):
            raise ValueError(f"{at}.format' ({g['format']!r}) is not supported (pack-quantized only)")
        w = g.get("weights")
        if not isinstance(w, Mapping):
            raise ValueError(f"{at}.weights' must be an object")
        extra = sorted(set(w) - CT_WEIGHT_FIELDS)
        if extra:
            raise ValueError(f"{at}.weights.{extra[0]}' is not supported")
        checks = {"type": w.get("type") == "int", "num_bits": w.get("num_bits") in (4, 8),
                  "strategy": w.get("strategy") in ("group", "channel"),
                  "group_size": w.get("strategy") != "group" or (isinstance(w.get("group_size"), int)
                                                                 and w["group_size"] > 0),
                  "dynamic": not w.get("dynamic"), "actorder": not w.get("actorder"),
                  "block_structure": not w.get("block_structure")}
        for key, ok in checks.items():
            if not ok:
                raise ValueError(f"{at}.weights.{key}' ({w.get(key)!r}) is not supported (int, 4 or 8 bits, group "
                                 "or channel strategy, static, no actorder)")
        bits.add(w["num_bits"])
    ignore = qc.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(i, str) for i in ignore):
        raise ValueError(f"{field}ignore' must be a list of module names, got {ignore!r}")
    return QuantScheme("compressed-tensors", bits=tuple(sorted(bits)), ignore=tuple(ignore))


class QuantTensor(nn.Module):
    """A low-bit weight [*lead, out, in] (lead: a stack of experts, or nothing), as shipped:
    - fp8: `qdata` float8_e4m3fn [*lead, out, in], `scale` fp32 [*lead, out, ceil(in / group)];
    - int8 / int4 (compressed-tensors pack-quantized): `qdata` uint8 [*lead, out, in] (int8 + 128) or
      [*lead, out, ceil(in / 2)] (two int4 + 8 per byte, low nibble first: the int32 words' own bytes),
      `scale` [*lead, out, in / group] in the checkpoint's dtype, `zero` int8 [*lead, out, in / group] or
      None (symmetric); w = (q - zero) * scale, computed in the scale's dtype (compressed-tensors' order).
    Row operations (`rows`, `permute_rows`, `cat`, `stack`) act on all of them; `dequant` gives the
    full-precision weight as a transient tensor, `linear` computes x @ W^T through it."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, group: int, scheme: str = "fp8",
                 zero: torch.Tensor | None = None, cols: int | None = None) -> None:
        super().__init__()
        cols = data.shape[-1] if cols is None else cols
        if scale.shape[:-1] != data.shape[:-1] or scale.shape[-1] != -(-cols // group) or \
                (zero is not None and zero.shape != scale.shape):
            raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight {(*data.shape[:-1], cols)} in "
                             f"groups of {group} columns")
        self.register_buffer("qdata", data)
        self.register_buffer("scale", scale)
        self.register_buffer("zero", zero)
        self.group, self.scheme, self.cols = group, scheme, cols
        self.fold = bool(scale.numel() == 0 or scale.abs().max() < 2.0 ** 7)  # fp8: scale * 2^120 stays finite

    @classmethod
    def from_fp8(cls, name: str, weight: torch.Tensor, scale_inv: torch.Tensor,
                 block: tuple[int, int]) -> QuantTensor:
        """A checkpoint's fp8 `weight` [*, out, in] and its block `scale_inv` [*, ceil(out/bo), ceil(in/bi)]."""
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight {name}: dtype {weight.dtype} where quantization_config.quant_method fp8 "
                             "expects float8_e4m3fn")
        out, cols = weight.shape[-2:]
        want = (*weight.shape[:-2], -(-out // block[0]), -(-cols // block[1]))
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"weight {name}_scale_inv: shape {tuple(scale_inv.shape)} != {want} for weight "
                             f"{tuple(weight.shape)} and quantization_config.weight_block_size {list(block)}")
        if ((weight.view(torch.uint8) & 0x7F) == 0x7F).any():
            raise ValueError(f"weight {name} holds float8_e4m3fn NaN values")
        scale = scale_inv.float().repeat_interleave(block[0], dim=-2)[..., :out, :].contiguous()
        return cls(weight.contiguous(), scale, block[1])

    @classmethod
    def from_packed(cls, name: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor,
                    zero: torch.Tensor | None, bits: tuple[int, ...]) -> QuantTensor:
        """compressed-tensors pack-quantized: `name`.weight_packed int32 [out, ceil(in * bits / 32)] (element i
        at bits i*bits.. of the little-endian stream, stored + 2^(bits-1)), weight_scale [out, in / group],
        weight_shape [out, in], weight_zero_point int32 [ceil(out * bits / 32), in / group] (packed along
        the rows) when asymmetric."""
        if packed.dtype != torch.int32 or packed.dim() != 2:
            raise ValueError(f"weight {name}_packed must be a 2-D int32 tensor, got {packed.dtype} "
                             f"{tuple(packed.shape)}")
        out, cols = (int(v) for v in shape.tolist())
        fits = [b for b in bits if packed.shape == (out, -(-cols * b // 32))]
        if len(fits) != 1:
            raise ValueError(f"weight {name}_packed: shape {tuple(packed.shape)} does not fit weight_shape "
                             f"{[out, cols]} at quantization_config num_bits {list(bits)}")
        b = fits[0]
        if scale.dim() != 2 or scale.shape[0] != out or cols % scale.shape[1]:
            raise ValueError(f"weight {name}_scale: shape {tuple(scale.shape)} does not give whole groups of "
                             f"weight_shape {[out, cols]} (group_size must divide the columns)")
        data = packed.contiguous().view(torch.uint8)  # little-endian: the bytes in element order
        if b == 4:
            data = data[:, : -(-cols // 2)]
        else:
            data = data[:, :cols]
        if zero is not None:
            groups = scale.shape[1]
            if zero.dtype != torch.int32 or zero.shape != (-(-out * b // 32), groups):
                raise ValueError(f"weight {name}_zero_point: shape {tuple(zero.shape)} does not fit {out} rows of "
                                 f"{groups} groups packed at {b} bits")
            z = _unpack(zero.t().contiguous().view(torch.uint8), b, out)  # [groups, out]
            zero = (z.to(torch.int16) - (1 << (b - 1))).to(torch.int8).t().contiguous()
        return cls(data.contiguous(), scale.contiguous(), cols // scale.shape[1], f"int{b}", zero, cols)

    @property
    def shape(self) -> torch.Size:
        """The logical (full-precision) weight's shape."""
        return torch.Size((*self.qdata.shape[:-1], self.cols))

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def _like(self, data: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> QuantTensor:
        return QuantTensor(data, scale, self.group, self.scheme, zero, self.cols)

    def _map(self, fn) -> QuantTensor:  # noqa: ANN001
        return self._like(fn(self.qdata), fn(self.scale), None if self.zero is None else fn(self.zero))

    def rows(self, first: int, end: int) -> QuantTensor:
        """Rows [first, end) of the last-but-one dimension."""
        return self._map(lambda t: t[..., first:end, :])

    def cols_slice(self, first: int, end: int) -> QuantTensor:
        """Columns [first, end): only the whole width (tensor parallelism is refused for quantized weights)."""
        if (first, end) != (0, self.cols):
            raise ValueError("column slices of quantized weights (tensor parallelism) are not supported yet")
        return self

    def permute_rows(self, index: torch.Tensor) -> QuantTensor:
        return self._map(lambda t: t.index_select(-2, index))

    @staticmethod
    def cat(parts: Sequence[QuantTensor]) -> QuantTensor:
        """Row-wise concatenation (q/k/v, gate/up) of weights of one scheme and group size."""
        first = _alike(parts, "fuse")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts], dim=-2)
        return first._like(torch.cat([p.qdata for p in parts], dim=-2), torch.cat([p.scale for p in parts], dim=-2),
                           zero)

    @staticmethod
    def stack(parts: Sequence[QuantTensor]) -> QuantTensor:
        """A new leading dimension (experts)."""
        first = _alike(parts, "stack")
        zero = None if first.zero is None else torch.stack([p.zero for p in parts])
        return first._like(torch.stack([p.qdata for p in parts]), torch.stack([p.scale for p in parts]), zero)

    def dequant(self, index: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The full-precision weight [out, in] (of expert `index` when stacked), a new tensor, in `dtype`.
        fp8: fp8 -> fp32 times the fp32 scale per group (transformers' arithmetic); int: (q - zero) * scale
        in the scale's dtype (compressed-tensors')."""
        pick = (lambda t: t) if index is None else (lambda t: t[index])  # noqa: E731
        data, scale = pick(self.qdata), pick(self.scale)
        if self.scheme == "fp8":
            w = fp8_bits_to_fp32(data)  # fp8 value * 2^-120, exactly
            if self.fold:  # 2^120 folded into the scale: one rounding of the exact product, as fp8 * scale
                scale = scale * 2.0 ** 120
            else:
                w.mul_(2.0 ** 120)
        else:  # (q + offset) - (offset + zero): exact small integers in the scale's dtype, one pass
            w = _unpack4(data, self.cols, scale.dtype) if self.scheme == "int4" else data.to(scale.dtype)
            offset = 8 if self.scheme == "int4" else 128
            if self.zero is None:
                w.sub_(offset)
            else:
                zero = pick(self.zero).to(scale.dtype).add_(offset)
                w.unflatten(-1, (-1, self.group)).sub_(zero[..., None])
        g, cols = self.group, w.shape[-1]
        full = cols // g
        if full:
            w[..., : full * g].unflatten(-1, (full, g)).mul_(scale[..., :full, None])
        if cols % g:
            w[..., full * g:].mul_(scale[..., full:])
        return w if w.dtype == dtype else w.to(dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None, index: int | None = None) -> torch.Tensor:
        """x [T, in] -> x W^T (+ bias) [T, out]: int8/int4 with fp32 scales on the CPU through quant_cpu's
        kernel (the bytes as stored, no full-precision weight); else W dequantized for this call only."""
        if self.scheme != "fp8" and x.dim() == 2:
            pick = (lambda t: t) if index is None else (lambda t: t[index])  # noqa: E731
            data, scale = pick(self.qdata), pick(self.scale)
            zero = None if self.zero is None else pick(self.zero)
            if quant_cpu.fits(x, data, scale, zero, self.scheme, self.group, self.cols):
                y = quant_cpu.gemm(x, data, scale, zero, self.scheme, self.group, self.cols)
                return y if bias is None else y.add_(bias)
        return F.linear(x, self.dequant(index, x.dtype), bias)


def _alike(parts: Sequence[QuantTensor], what: str) -> QuantTensor:
    """The first of `parts` once all share its scheme, group size, columns and zero points (else ValueError)."""
    first = parts[0]
    key = (first.scheme, first.group, first.cols, first.zero is None)
    if any((p.scheme, p.group, p.cols, p.zero is None) != key for p in parts):
        raise ValueError(f"cannot {what} quantized weights of different schemes, group sizes or zero points")
    return first


def _unpack(data: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 [..., m] holding `bits`-bit values in element order (int4: low nibble first) -> uint8 [..., n]."""
    if bits == 8:
        return data[..., :n]
    return torch.stack([data & 0xF, data >> 4], dim=-1).flatten(-2)[..., :n]


def _unpack4(data: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 [..., m] of two int4 (+ 8) per byte, low nibble first -> their unsigned values [..., n] in `dtype`,
    written straight into the output (two strided passes)."""
    out = torch.empty((*data.shape[:-1], 2 * data.shape[-1]), dtype=dtype, device=data.device)
    out[..., 0::2].copy_(data & 0xF)
    out[..., 1::2].copy_(data >> 4)
    return out[..., :n]


_FP8_MASK = 0x87F00000 - (1 << 32)  # sign bit and the 7 exponent+mantissa bits, moved into fp32's fields


def fp8_bits_to_fp32(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [...] -> fp32 [...] holding value * 2^-120, exactly, in three vectorized integer passes
    (torch's own fp8 -> fp32 cast runs about 30x slower on the CPU). e4m3's 4 exponent and 3 mantissa
    bits land in fp32's low exponent bits and top mantissa bits (bias 7 against 127: the 2^-120), its
    subnormals become fp32 subnormals; NaN (refused at load) would read 480."""
    bits = q.view(torch.int8).to(torch.int32)  # sign-extended: the mask keeps bit 31 and bits 26..20
    bits.bitwise_left_shift_(20).bitwise_and_(_FP8_MASK)
    return bits.view(torch.float32)


def wrap(raw: Mapping[str, torch.Tensor], scheme: QuantScheme | None) -> dict[str, torch.Tensor | QuantTensor]:
    """The checkpoint's tensors with each quantized weight (and its scales) as one QuantTensor under the
    weight's name, so the families' `weights` take it like any weight. Without a scheme, a checkpoint
    holding quantization tensors is refused (config.json lacks its quantization_config)."""
    if scheme is None:
        stray = sorted(n for n in raw if n.rsplit(".", 1)[-1] in SCALE_SUFFIXES)
        if stray:
            raise ValueError(f"the checkpoint holds quantization tensors {stray[:3]} but config.json has no "
                             "'quantization_config'")
        return dict(raw)
    if scheme.method == "compressed-tensors":
        return _wrap_packed(raw, scheme)
    out: dict[str, torch.Tensor | QuantTensor] = {}
    for name, t in raw.items():
        if name.endswith(".weight_scale_inv"):
            if name[: -len("_scale_inv")] not in raw:
                raise ValueError(f"weight {name} has no weight {name[: -len('_scale_inv')]} to scale")
            continue
        if name.endswith(".input_scale"):  # static activation scales: refused by parse, never here
            raise ValueError(f"weight {name}: static activation scales are not supported")
        scale = raw.get(name + "_scale_inv")
        if scale is not None:
            out[name] = QuantTensor.from_fp8(name, t, scale, scheme.block)
        elif t.dtype == torch.float8_e4m3fn:
            raise ValueError(f"weight {name} is float8_e4m3fn without a {name}_scale_inv")
        else:
            out[name] = t
    return out


def _wrap_packed(raw: Mapping[str, torch.Tensor], scheme: QuantScheme) -> dict[str, torch.Tensor | QuantTensor]:
    """compressed-tensors: each module's weight_packed / weight_scale / weight_shape (/ weight_zero_point)
    -> one QuantTensor named `<module>.weight`; modules on its ignore list ship a plain `weight`."""
    out: dict[str, torch.Tensor | QuantTensor] = {}
    parts = ("weight_scale", "weight_shape", "weight_zero_point")
    for name, t in raw.items():
        base, _, leaf = name.rpartition(".")
        if leaf == "weight_g_idx":
            raise ValueError(f"weight {name}: activation-ordered (actorder) weights are not supported")
        if leaf in parts:
            if base + ".weight_packed" not in raw:
                raise ValueError(f"weight {name} has no {base}.weight_packed")
            continue
        if leaf != "weight_packed":
            out[name] = t
            continue
        for need in parts[:2]:
            if f"{base}.{need}" not in raw:
                raise ValueError(f"weight {base}.{need} is missing (for {name})")
        out[base + ".weight"] = QuantTensor.from_packed(
            base + ".weight", t, raw[base + ".weight_scale"], raw[base + ".weight_shape"],
            raw.get(base + ".weight_zero_point"), scheme.bits)
    return out


def quantized_modules(model: nn.Module) -> list[tuple[str, QuantTensor]]:
    """(name, QuantTensor) of every quantized weight a loaded model holds."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantTensor)]


def int4_group(cols: int) -> int:
    """The int4 group size for a weight of `cols` columns: the largest of 128, 64, 32, 16 dividing it."""
    for g in (128, 64, 32, 16):
        if cols % g == 0:
            return g
    raise ValueError(f"--quantization int4 needs weights whose column count is a multiple of 16, got {cols}")


def quantize(w: torch.Tensor, scheme: str) -> QuantTensor:
    """A full-precision weight [out, in] -> QuantTensor `scheme` ("int8": per output channel; "int4": per
    group of int4_group(in) columns), symmetric, fp32 scales, round to nearest."""
    w = w.detach().float()
    out, cols = w.shape
    if scheme == "int8":
        group, qmax, offset = cols, 127, 128
    elif scheme == "int4":
        group, qmax, offset = int4_group(cols), 7, 8
    else:
        raise ValueError(f"--quantization must be one of {', '.join(quant_cpu.SCHEMES)}, got {scheme!r}")
    g = w.unflatten(-1, (cols // group, group))
    scale = (g.abs().amax(-1) / qmax).clamp(min=1e-12)  # [out, groups]
    q = torch.round(g / scale[..., None]).clamp(-qmax - 1, qmax).flatten(-2).to(torch.int16) + offset
    data = q.to(torch.uint8)
    if scheme == "int4":
        data = data[:, 0::2] | (data[:, 1::2] << 4)
    return QuantTensor(data.contiguous(), scale.contiguous(), group, scheme, None, cols)
