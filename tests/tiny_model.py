"""A tiny Llama with random weights, written as an HF model directory (config.json + safetensors):
the engine loads it like any checkpoint, in well under a second. No tokenizer: requests carry ids
and no stop strings. Config fields can be overridden (e.g. model_type="mistral", sliding_window=16:
the same weights as a sliding-window model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

CONFIG = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": True,
    "eos_token_id": 255,
}


def make_tiny_model(dst: Path, seed: int = 0, **overrides: object) -> Path:
    c = CONFIG | overrides
    h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    t = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": w(h, h), p + "self_attn.k_proj.weight": w(kv, h),
              p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, h),
              p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
              p + "mlp.down_proj.weight": w(h, inter), p + "input_layernorm.weight": torch.ones(h),
              p + "post_attention_layernorm.weight": torch.ones(h)}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(c))
    save_file(t, str(dst / "model.safetensors"))
    return dst
