"""Load an HF model directory (config.json + *.safetensors) into its family's Model (registry.py).

The family's `weights` maps checkpoint names to the Model's parameter names, sliced for the TP rank;
missing or unexpected weights, a parameter no weight fills, or a shape mismatch raise ValueError naming
them. Rotary tables are built on the target device in fp32; fp32 CPU linears are packed once
(cpu_gemm.pack_model).

A quantized checkpoint (config.json's `quantization_config`, engine/models/quant.py) keeps its weights
low-bit: each quantized weight reaches the Model as a QuantTensor, which replaces the parameter while
the Model is still on the meta device (so no full-precision copy is ever allocated) and is attached after
the dtype cast as `<name>_quant` (an nn.Linear's `weight_quant`, SparseMoE's `w13_quant`/`w2_quant`,
MLAAttention's `kv_b_quant`). A quantized weight anywhere else (an embedding, a norm, the LM head) is
refused by name, and so is tensor parallelism over quantized weights (not supported yet).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.cpu_gemm import pack_model
from engine.models.quant import QuantTensor, parse, quantize, wrap
from engine.models.registry import family
from engine.models.rope import Rotary
from engine.models.vision import VisionTower, tower_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                out[name] = fh.get_tensor(name)
    return out


def load_model(path: Path, cfg: ModelConfig, dtype: str, device: str, max_pos: int,
               cpu_gemm: str = "onednn", tp: TPGroup = SINGLE, quantization: str = "none") -> nn.Module:
    """The family's Model for cfg.model_type, holding rank tp.rank's share of the weights at `path`, on
    `device` in `dtype`, with rotary tables for positions < max_pos. `quantization` int8 / int4 quantizes
    the decoder layers' nn.Linear weights of a full-precision checkpoint here (engine/models/quant_cpu.py)."""
    fam = family(cfg.model_type)
    try:
        scheme = parse(json.loads((Path(path) / "config.json").read_text()))
        raw = wrap(_read_tensors(Path(path)), scheme)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    if scheme is not None and quantization != "none":
        raise ValueError(f"{path}: --quantization {quantization} quantizes a full-precision checkpoint, but this one "
                         f"is already quantized ({scheme.describe()}, config.json's quantization_config); drop "
                         "--quantization to run it as shipped")
    if (scheme is not None or quantization != "none") and tp.size > 1:
        what = f"quantization_config.quant_method {scheme.method!r}" if scheme else f"--quantization {quantization}"
        raise ValueError(f"{path}: tensor parallelism (tp {tp.size}) over a quantized checkpoint ({what}) is not "
                         "supported yet; use tp 1")
    with torch.device("meta"):
        model = fam.Model(cfg, max_pos, tp)
    try:
        params = fam.weights(raw, cfg, tp)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    unfilled = sorted(set(dict(model.named_parameters())) - set(params))
    if unfilled:
        raise ValueError(f"{path}: no weight for parameters {unfilled[:5]}")
    if quantization != "none":
        params = _quantize(model, params, quantization)
    quantized = {name: params.pop(name) for name in [n for n, t in params.items() if isinstance(t, QuantTensor)]}
    for name, q in quantized.items():  # still on meta: the full-precision parameter is never allocated
        _check_shape(name, q, model.get_parameter(name))
        owner, attr = _quantizable(model, name)
        setattr(owner, attr, nn.Parameter(torch.empty(0), requires_grad=False))
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in params.items():
            target = model.get_parameter(name)
            _check_shape(name, tensor, target)
            target.copy_(tensor)
    model = model.to(dtype=DTYPES[dtype])
    for name, q in quantized.items():  # after the dtype cast, which would widen the low-bit values
        owner, attr = _quantizable(model, name)
        owner.register_module(f"{attr}_quant", q.to(device))
    # rotary tables were allocated on meta; rebuild them on the target device in fp32
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_pos).to(device)
    pack_model(model, cpu_gemm)
    for m in model.modules():  # blocks holding weights other than nn.Linear (MoE experts) pack their own
        if hasattr(m, "pack_weights"):
            m.pack_weights(cpu_gemm)
    return model.eval()


def _quantize(model: nn.Module, params: dict, scheme: str) -> dict:
    """`--quantization`: every 2-D nn.Linear weight of the decoder layers -> a QuantTensor (quant.quantize);
    embeddings, norms, the LM head and anything else stay as they are."""
    out = dict(params)
    for name, t in params.items():
        prefix, _, attr = name.rpartition(".")
        if (name.startswith("layers.") and attr == "weight" and isinstance(t, torch.Tensor) and t.dim() == 2
                and isinstance(model.get_submodule(prefix), nn.Linear)):
            out[name] = quantize(t, scheme)
    return out


def _check_shape(name: str, tensor: torch.Tensor | QuantTensor, target: torch.Tensor) -> None:
    if target.shape != tensor.shape:
        raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")


def _quantizable(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    """(module, attribute) of parameter `name` when it may be held low-bit: an nn.Linear's weight inside
    the decoder layers, or a parameter a module lists in QUANTIZABLE (MoE expert stacks, MLA's kv_b);
    else ValueError naming it (embeddings, norms and the LM head run as they ship: unquantized)."""
    prefix, _, attr = name.rpartition(".")
    owner = model.get_submodule(prefix)
    linear = isinstance(owner, nn.Linear) and attr == "weight" and name.startswith("layers.")
    if not (linear or attr in getattr(owner, "QUANTIZABLE", ())):
        raise ValueError(f"weight {name} is quantized in the checkpoint, but this engine runs it only in full "
                         "precision (embeddings, norms and the LM head are loaded unquantized)")
    return owner, attr


def load_tower(path: Path, cfg: ModelConfig, dtype: str, device: str) -> nn.Module:
    """The vision tower alone of the vision-language checkpoint at `path` (`pdserve encoder`: no language model,
    no KV pool), on `device` in `dtype`; ValueError for a text-only model or a missing tower weight."""
    if cfg.vision is None:
        raise ValueError(f"{path}: {cfg.model_type} has no vision tower (config.json has no vision_config)")
    try:
        params = tower_weights(_read_tensors(Path(path)), cfg)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    with torch.device("meta"):
        tower = VisionTower(cfg)
    tower = tower.to_empty(device=device)
    with torch.no_grad():
        for name, p in tower.named_parameters():
            p.copy_(params[name])
    return tower.to(dtype=DTYPES[dtype]).eval()
