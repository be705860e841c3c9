"""GGUF -> HF model directory: the one-time conversion of the embedded model (engine/models/embedded.py).

llama.cpp's GGUF holds Q4_1/Q8_0 weights with q/k rows permuted for interleaved RoPE; the directory
holds fp32 safetensors in HF's rotate-half order, config.json, generation_config.json and the
tokenizer files, and loads like any other HF Llama-family directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows permuted for interleaved RoPE; HF uses rotate-half order.
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _field(reader, key: str):  # noqa: ANN001
    return reader.fields[key].contents()


def convert(src: Path, dst: Path) -> None:
    """GGUF -> HF directory (fp32 safetensors, config.json, tokenizer files)."""
    reader = gguf.GGUFReader(str(src))
    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(x) for x in reversed(t.shape)]) if w.ndim != len(t.shape) else w
        name = t.name
        if name == "token_embd.weight":
            tensors["model.embed_tokens.weight"] = torch.from_numpy(np.ascontiguousarray(w))
            continue
        if name == "output_norm.weight":
            tensors["model.norm.weight"] = torch.from_numpy(np.ascontiguousarray(w))
            continue
        if name == "output.weight":
            tensors["lm_head.weight"] = torch.from_numpy(np.ascontiguousarray(w))
            continue
        _, layer, kind, _ = name.split(".")
        if kind == "attn_q":
            w = _unpermute(w, n_head)
        elif kind == "attn_k":
            w = _unpermute(w, n_kv)
        tensors[f"model.layers.{layer}.{_NAMES[kind]}.weight"] = torch.from_numpy(np.ascontiguousarray(w))
    hidden = int(_field(reader, "llama.embedding_length"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": hidden // n_head,
        "vocab_size": int(_field(reader, "llama.vocab_size")),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}))
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(dst))
