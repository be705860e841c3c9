"""Load an HF Llama-family directory (config.json + *.safetensors) into LlamaForCausalLM.

q/k/v projections are fused into one qkv_proj, gate/up into gate_up_proj; everything else maps by
name. Missing or unexpected weights raise ValueError naming them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.models.cpu_gemm import pack_model
from engine.models.llama import LlamaForCausalLM

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
               cpu_gemm: str = "onednn") -> LlamaForCausalLM:
    raw = _read_tensors(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_pos)
    params: dict[str, torch.Tensor] = {}
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in raw:
            raise ValueError(f"{path}: weight {name} is missing")
        taken.add(name)
        return raw[name]

    params["embed_tokens.weight"] = take("model.embed_tokens.weight")
    params["norm.weight"] = take("model.norm.weight")
    if not cfg.tie_embeddings:
        params["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        params[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
            [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")])
        if cfg.qkv_bias:
            params[f"layers.{i}.self_attn.qkv_proj.bias"] = torch.cat(
                [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")])
        params[f"layers.{i}.self_attn.o_proj.weight"] = take(a + "o_proj.weight")
        params[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        params[f"layers.{i}.mlp.down_proj.weight"] = take(p + "mlp.down_proj.weight")
        params[f"layers.{i}.input_layernorm.weight"] = take(p + "input_layernorm.weight")
        params[f"layers.{i}.post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
    # tied checkpoints sometimes carry lm_head anyway; rotary buffers are not weights
    extra = set(raw) - taken - {"lm_head.weight"}
    extra = {n for n in extra if "rotary_emb" not in n}
    if extra:
        raise ValueError(f"{path}: unexpected weights {sorted(extra)[:5]}")
    tdtype = DTYPES[dtype]
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, tensor in params.items():
            target = model.get_parameter(name)
            if target.shape != tensor.shape:
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(target.shape)}")
            target.copy_(tensor)
    model = model.to(dtype=tdtype)
    # rotary tables were allocated on meta; rebuild them on the target device in fp32
    rot = type(model.rotary)(cfg, max_pos)
    model.rotary = rot.to(device)
    pack_model(model, cpu_gemm)
    return model.eval()
