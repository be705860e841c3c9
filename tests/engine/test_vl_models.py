"""The vision-language families (engine/models/qwen2_5_vl.py, qwen3_vl.py, vision.py, mrope.py) against
transformers in fp32, on tiny random-weight checkpoints (tests/vl_models.py).

For each family the Model is loaded by the engine's loader (the family's config and weights), the images
(random pixels, two sizes) go through transformers' image processor, and the prompt is text + vision_start +
one image pad per merged patch + vision_end + text:
- teacher-forced logits over the whole prompt within 1e-3 of transformers' (no image, one image, two images);
- 16 greedy tokens identical to transformers' generate: ours prefill the prompt into the paged KV pool once,
  then decode one token at a time at M-RoPE position p + delta;
- positions_3d equals transformers' get_rope_index (positions and delta), and refuses image runs that do not
  match the grids;
- both checkpoint namings (the Qwen2.5-VL hub's and transformers 5's) and both config layouts load the same;
  missing or unexpected weights and tp > 1 are refused by name.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from engine.attention.base import build_metadata
from engine.attention.registry import create_backend
from engine.config import ModelConfig
from engine.distributed.tp import TPGroup
from engine.kvcache.memory import KVPool, pages_for
from engine.models.layers import ForwardContext
from engine.models.loader import load_model
from engine.models.mrope import decode_positions, positions_3d
from engine.models.registry import family as family_module
from tests.vl_models import hf_model, image_processor, vl_checkpoint

PS = 16  # KV page size
NEW = 16  # greedy tokens
SIZES = {"qwen2_5_vl": [(84, 56), (112, 140)], "qwen3_vl": [(96, 64), (128, 160)]}  # PIL (width, height)


@pytest.fixture(scope="session")
def vl_root(tmp_path_factory):  # noqa: ANN001, ANN201
    return tmp_path_factory.mktemp("vl")


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def vl(request, vl_root):  # noqa: ANN001, ANN201
    """(kind, path, ModelConfig, our Model, transformers' model, tokenizer, image processor)."""
    from transformers import AutoTokenizer

    kind = request.param
    path = vl_checkpoint(kind, vl_root)
    cfg = ModelConfig.from_dir(path)
    ours = load_model(path, cfg, "float32", "cpu", 512)
    return kind, path, cfg, ours, hf_model(path), AutoTokenizer.from_pretrained(str(path)), image_processor(path)


def _images(kind: str, n: int) -> list:
    from PIL import Image

    g = torch.Generator().manual_seed(7)
    return [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
            for w, h in SIZES[kind][:n]]


def _prompt(vl, n_images: int) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:  # noqa: ANN001
    """(ids, pixel_values, image_grid_thw) of a prompt with `n_images` images between text."""
    kind, _, cfg, _, _, tok, proc = vl
    texts = ["Describe the picture:", " and this one", " in a few words."]
    if n_images == 0:
        return tok.encode(" ".join(texts)), None, None
    out = proc(images=_images(kind, n_images), return_tensors="pt")
    pixels, grids = out["pixel_values"], out["image_grid_thw"]
    vs, ve = cfg.vision_start_token_id, tok.convert_tokens_to_ids("<|vision_end|>")
    ids = tok.encode(texts[0])
    for k, (t, h, w) in enumerate(grids.tolist()):
        ids += [vs] + [cfg.image_token_id] * (t * h * w // cfg.spatial_merge_size ** 2) + [ve]
        ids += tok.encode(texts[k + 1] if k + 1 < len(texts) else "?")
    return ids, pixels, grids


def _hf_inputs(cfg: ModelConfig, ids: list[int], pixels: torch.Tensor | None, grids: torch.Tensor | None) -> dict:
    x = torch.tensor([ids])
    inputs = {"input_ids": x, "attention_mask": torch.ones_like(x)}
    if pixels is not None:
        inputs |= {"pixel_values": pixels, "image_grid_thw": grids,
                   "mm_token_type_ids": (x == cfg.image_token_id).int()}
    return inputs


class _Run:
    """One request's pages in a fresh KV pool and a forward over new tokens (the engine's ForwardContext)."""

    def __init__(self, model, cfg: ModelConfig, n: int, dtype: torch.dtype = torch.float32) -> None:  # noqa: ANN001
        self.model, self.cfg = model, cfg
        self.pool = KVPool(pages_for(n, PS) + 2, cfg.num_kv_layers, PS, model.local_kv_heads, cfg.head_dim, dtype,
                           "cpu")
        self.pages = list(range(1, pages_for(n, PS) + 1))
        self.backend = create_backend("cpu" if dtype == torch.float32 else "torch")

    def forward(self, start: int, ids: list[int], positions: torch.Tensor, embeds: torch.Tensor | None = None,
                deepstack: tuple | None = None) -> torch.Tensor:
        n, pos = len(ids), range(start, start + len(ids))
        meta = build_metadata([self.pages], [start + n], [n], PS, self.cfg.head_dim ** -0.5, "cpu")
        ctx = ForwardContext(pool=self.pool, backend=self.backend, meta=meta,
                             out_page=torch.tensor([self.pages[p // PS] for p in pos]),
                             out_offset=torch.tensor([p % PS for p in pos]),
                             native=getattr(self.backend, "native", None))
        hidden = self.model(torch.tensor(ids), positions, ctx, input_embeds=embeds, deepstack=deepstack)
        return self.model.logits(hidden)


def _ours(vl, ids: list[int], pixels: torch.Tensor | None, grids: torch.Tensor | None,  # noqa: ANN001
          new: int = 0) -> tuple[torch.Tensor, list[int]]:
    """(our prompt logits [len(ids), V], `new` greedy tokens decoded one at a time after the prompt)."""
    _, _, cfg, model, _, _, _ = vl
    run = _Run(model, cfg, len(ids) + new)
    grid_list = [] if grids is None else [tuple(g) for g in grids.tolist()]
    positions, delta = positions_3d(ids, grid_list, cfg)
    with torch.inference_mode():
        x = torch.tensor(ids)
        embeds, deepstack = model.embed_tokens(x), None
        if pixels is not None:
            rows = (x == cfg.image_token_id).nonzero().squeeze(1)
            image, deep = model.encode_images(pixels, grids)
            embeds = embeds.index_copy(0, rows, image)
            deepstack = None if deep is None else (rows, deep)
        logits = run.forward(0, ids, positions, embeds, deepstack)
        tokens = [int(logits[-1].argmax())]
        for p in range(len(ids), len(ids) + new - 1):
            step = run.forward(p, tokens[-1:], decode_positions(torch.tensor([p]), delta))
            tokens.append(int(step[-1].argmax()))
    return logits, tokens[:new]


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_teacher_forced_logits_and_greedy_match_transformers(vl, n_images):
    kind, _, cfg, _, hf, _, _ = vl
    ids, pixels, grids = _prompt(vl, n_images)
    if n_images:
        assert grids.tolist()[0][1:] != grids.tolist()[-1][1:] or n_images == 1  # two different sizes
    inputs = _hf_inputs(cfg, ids, pixels, grids)
    with torch.no_grad():
        ref = hf(**inputs).logits[0].float()
        want = hf.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                           pad_token_id=0)[0, len(ids):].tolist()
    logits, tokens = _ours(vl, ids, pixels, grids, NEW)
    assert ref.abs().max() > 1.0  # large enough for 1e-3 to mean something
    diff = (logits - ref).abs().max().item()
    print(f"{kind} {n_images} images, {len(ids)} tokens: max abs logit diff {diff:.2e}")
    assert diff < 1e-3
    assert tokens == want


def test_positions_equal_get_rope_index(vl):
    _, _, cfg, _, hf, _, _ = vl
    for n in (0, 1, 2):
        ids, _, grids = _prompt(vl, n)
        got, delta = positions_3d(ids, [] if grids is None else [tuple(g) for g in grids.tolist()], cfg)
        if n == 0:
            assert torch.equal(got, torch.arange(len(ids)).expand(3, -1)) and delta == 0
            continue
        x = torch.tensor([ids])
        want, want_delta = hf.model.get_rope_index(x, mm_token_type_ids=(x == cfg.image_token_id).int(),
                                                   image_grid_thw=grids)
        assert torch.equal(got, want[:, 0]) and delta == int(want_delta) and delta < 0


def test_mismatched_image_runs_are_refused(vl):
    _, _, cfg, _, _, _, _ = vl
    ids, _, grids = _prompt(vl, 2)
    grid_list = [tuple(g) for g in grids.tolist()]
    with pytest.raises(ValueError, match="2 image token runs but 1 images"):
        positions_3d(ids, grid_list[:1], cfg)
    with pytest.raises(ValueError, match="image 0: its run has"):
        positions_3d(ids, grid_list[::-1], cfg)
    first = ids.index(cfg.image_token_id)
    with pytest.raises(ValueError, match="not preceded by the vision_start"):
        positions_3d(ids[: first - 1] + [ids[0]] + ids[first:], grid_list, cfg)


def test_both_checkpoint_namings_and_config_layouts_load_the_same(vl, tmp_path):
    kind, path, cfg, _, _, _, _ = vl
    fam = family_module(kind)
    raw = load_file(str(path / "model.safetensors"))
    base = fam.weights(raw, cfg, TPGroup())

    def rename(name: str) -> str:  # the other naming of each checkpoint
        for a, b in (("model.language_model.", "model."), ("model.visual.", "visual."),
                     ("model.", "model.language_model."), ("visual.", "model.visual.")):
            if name.startswith(a):
                return b + name[len(a):]
        return name

    other = fam.weights({rename(n): t for n, t in raw.items()}, cfg, TPGroup())
    assert other.keys() == base.keys() and all(torch.equal(other[k], base[k]) for k in base)
    victim = next(n for n in raw if "blocks.1.attn.qkv.weight" in n)
    with pytest.raises(ValueError, match=victim.replace(".", r"\.")):
        fam.weights({n: t for n, t in raw.items() if n != victim}, cfg, TPGroup())
    with pytest.raises(ValueError, match="unexpected weights.*visual.extra"):
        fam.weights(raw | {"visual.extra.weight": torch.zeros(1)}, cfg, TPGroup())

    hf_cfg = json.loads((path / "config.json").read_text())
    assert "text_config" in hf_cfg
    text = hf_cfg["text_config"]
    rope = text["rope_parameters"]
    flat = {k: v for k, v in hf_cfg.items() if k != "text_config"} | {
        k: v for k, v in text.items() if k not in ("rope_parameters", "model_type", "tie_word_embeddings")}
    flat |= {"rope_theta": rope["rope_theta"],
             "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert fam.config(flat) == cfg  # the hub's flat Qwen2.5-VL layout
    assert cfg.vision is not None and cfg.spatial_merge_size == 2
    assert cfg.mrope_interleaved == (kind == "qwen3_vl") and cfg.deepstack_layers == (2 if kind == "qwen3_vl" else 0)
    assert cfg.tie_embeddings == (kind == "qwen2_5_vl")


def test_tp_above_1_and_bad_configs_are_refused(vl):
    kind, path, cfg, _, _, _, _ = vl
    fam = family_module(kind)
    with pytest.raises(ValueError, match="--tp 1"), torch.device("meta"):
        fam.Model(cfg, 64, TPGroup(0, 2))
    hf_cfg = json.loads((path / "config.json").read_text())
    rope = hf_cfg["text_config"]["rope_parameters"]
    text = hf_cfg["text_config"]
    bad_section = hf_cfg | {"text_config": text | {"rope_parameters": rope | {"mrope_section": [1, 1, 1]}}}
    with pytest.raises(ValueError, match="mrope_section"):
        fam.config(bad_section)
    bad_out = hf_cfg | {"vision_config": hf_cfg["vision_config"] | {"out_hidden_size": 32}}
    with pytest.raises(ValueError, match="out_hidden_size"):
        fam.config(bad_out)
    assert dataclasses.replace(cfg, vision=None).vision is None  # a plain ModelConfig default is text-only
    assert ModelConfig.from_hf({"num_attention_heads": 4, "num_hidden_layers": 1, "hidden_size": 64,
                                "intermediate_size": 128, "vocab_size": 100}).mrope_section == ()


def test_bfloat16_runs_in_the_model_dtype(vl):
    """bf16 weights (the torch attention backend): the tower's and the decoder's outputs stay bf16, and the
    logits are no farther from fp32's than transformers' own bf16 run is (bf16 rounding only)."""
    from transformers import AutoModelForImageTextToText

    kind, path, cfg, _, hf, _, _ = vl
    model = load_model(path, cfg, "bfloat16", "cpu", 512)
    ids, pixels, grids = _prompt(vl, 2)
    with torch.inference_mode():
        image, deep = model.encode_images(pixels, grids)
        assert image.dtype == torch.bfloat16 and (deep is None) == (kind == "qwen2_5_vl")
        assert deep is None or (deep.dtype == torch.bfloat16 and deep.shape == (2, *image.shape))
    run = _Run(model, cfg, len(ids), torch.bfloat16)
    positions, _ = positions_3d(ids, [tuple(g) for g in grids.tolist()], cfg)
    with torch.inference_mode():
        x = torch.tensor(ids)
        rows = (x == cfg.image_token_id).nonzero().squeeze(1)
        embeds = model.embed_tokens(x).index_copy(0, rows, image)
        logits = run.forward(0, ids, positions, embeds, None if deep is None else (rows, deep))
    hf_bf16 = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.bfloat16,
                                                          attn_implementation="eager").eval()
    inputs = _hf_inputs(cfg, ids, pixels, grids)
    with torch.no_grad():
        want = hf(**inputs).logits[0].float()
        theirs = (hf_bf16(**inputs).logits[0].float() - want).abs().max().item()
    diff = (logits - want).abs().max().item()
    print(f"{kind} bf16 vs fp32: max abs logit diff {diff:.2e}, transformers' bf16 {theirs:.2e}")
    assert diff < 2 * theirs
