"""Load an HF model directory (config.json + *.safetensors) into its family's Model (registry.py).

The family's `weights` maps checkpoint names to the Model's parameter names, sliced for the TP rank;
missing or unexpected weights, a parameter no weight fills, or a shape mismatch raise ValueError naming
them. Rotary tables are built on the target device in fp32; fp32 CPU linears are packed once
(cpu_gemm.pack_model).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.cpu_gemm import pack_model
from engine.models.registry import family
from engine.models.rope import Rotary

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
               cpu_gemm: str = "onednn", tp: TPGroup = SINGLE) -> nn.Module:
    """The family's Model for cfg.model_type, holding rank tp.rank's share of the weights at `path`, on
    `device` in `dtype`, with rotary tables for positions < max_pos."""
    fam = family(cfg.model_type)
    raw = _read_tensors(Path(path))
    with torch.device("meta"):
        model = fam.Model(cfg, max_pos, tp)
    try:
        params = fam.weights(raw, cfg, tp)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    unfilled = sorted(set(dict(model.named_parameters())) - set(params))
    if unfilled:
        raise ValueError(f"{path}: no weight for parameters {unfilled[:5]}")
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in params.items():
            target = model.get_parameter(name)
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            target.copy_(tensor)
    model = model.to(dtype=DTYPES[dtype])
    # rotary tables were allocated on meta; rebuild them on the target device in fp32
    model.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_pos).to(device)
    pack_model(model, cpu_gemm)
    for m in model.modules():  # blocks holding weights other than nn.Linear (MoE experts) pack their own
        if hasattr(m, "pack_weights"):
            m.pack_weights(cpu_gemm)
    return model.eval()
