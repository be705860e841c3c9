"""Vision-language requests through the engine in-process (issue 50): the service's own parse, image
preprocessing and prompt expansion build the GenerateReq, the colocated role runs it (the tower, M-RoPE
positions and deepstack through ModelRunner's batch), on both families' tiny random-weight checkpoints
(tests/vl_models.py). transformers is the oracle: 16 greedy tokens for one image and for two of different
sizes, with prompt chunks so small that images are split across them, in one continuous batch; n > 1
choices decode from the prompt's delta; a later request with the same image reuses its cached pages and
does not run the tower again; a different image of the same size does.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from colocated_service.worker import ColocatedRole
from engine.config import EngineConfig
from engine.forward.model_runner import ModelRunner
from service import image_prompt
from service.images import ImageProcessor
from service.messages import GenerateReq
from service.protocol import Limits, parse_generate
from service.tokenizer import load_tokenizer
from tests.pd_harness import collect, kv_manager
from tests.vl_models import WRITERS, data_url, hf_model, image_processor, random_image

TOKENS = 16
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=list(WRITERS))
def vl(request, tmp_path_factory):  # noqa: ANN001, ANN201
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp(request.param)
    WRITERS[request.param](path)
    cfg = EngineConfig(model=str(path), max_total_tokens=4096, page_size=8, chunked_prefill_size=8,
                       max_prefill_tokens=24, threads=1, prefix_cache=True)
    runner = ModelRunner(cfg)
    role = ColocatedRole(cfg, runner, kv_manager(runner, prefix_cache=True))
    tok = load_tokenizer(path)
    mc = runner.model_cfg
    limits = Limits(role="colocated", context_length=2048, vocab_size=mc.vocab_size, model_name="m",
                    image_tokens=(mc.vision_start_token_id, mc.image_token_id, tok._tok.convert_tokens_to_ids(
                        "<|vision_end|>")))
    return path, role, tok, limits, ImageProcessor.from_model_dir(path), hf_model(path), image_processor(path)


def _req(vl, text: str, images: list[Image.Image], n: int = 1) -> GenerateReq:  # noqa: ANN001
    """The GenerateReq the frontend would send: parsed, images preprocessed, image tokens expanded."""
    _, _, tok, limits, proc, _, _ = vl
    body = {"text": text, "image_data": [data_url(i) for i in images],
            "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "n": n}}
    parsed = parse_generate(body, tok, limits)
    image_prompt.expand(parsed, [proc.process(i) for i in images], limits)
    return parsed.req


def _run(vl, reqs: list[GenerateReq]) -> dict:  # noqa: ANN001
    role = vl[1]
    tokens: dict[str, list[int]] = {}
    done: dict = {}
    for r in reqs:
        collect(role.add(r), tokens, done)
    want = sum(r.n for r in reqs)
    while len(done) < want:
        collect(role.step(), tokens, done)
    assert all(o.error is None for o in done.values()), [o.error for o in done.values()]
    return {k: (tokens[k], done[k]) for k in tokens}


def _hf(vl, req: GenerateReq, images: list[Image.Image]) -> list[int]:  # noqa: ANN001
    hf, proc = vl[5], vl[6]
    pix = proc(images=images, return_tensors="pt")
    x = torch.tensor([req.input_ids])
    with torch.no_grad():
        gen = hf.generate(x, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                          mm_token_type_ids=(x == hf.config.image_token_id).int(), max_new_tokens=TOKENS,
                          min_new_tokens=TOKENS, do_sample=False)
    return gen[0, x.shape[1]:].tolist()


def test_greedy_matches_transformers_with_images_split_across_chunks(vl):
    cases = [("one image " + VISION + " in the middle", [random_image(112, 84, 1)]),
             (f"two {VISION} and {VISION} images", [random_image(84, 56, 2), random_image(112, 112, 3)])]
    reqs = [_req(vl, text, imgs) for text, imgs in cases]
    # several 8-token chunks, an image across their edges
    assert all(len(r.input_ids) > 2 * 8 and any(x.offset % 8 + x.tokens > 8 for x in r.images) for r in reqs)
    out = _run(vl, reqs)  # one continuous batch
    for r, (_, imgs) in zip(reqs, cases):
        assert out[r.rid][0] == _hf(vl, r, imgs)
    vl[1].kv.flush()


def test_n_choices_decode_from_the_prompts_positions(vl):
    img = random_image(56, 56, 4)
    req = _req(vl, f"pick {VISION}", [img], n=3)
    out = _run(vl, [req])
    want = _hf(vl, req, [img])
    assert len(out) == 3 and all(tokens == want for tokens, _ in out.values())  # greedy: every choice the same
    vl[1].kv.flush()


def test_a_repeated_image_reuses_pages_and_skips_the_tower(vl):
    role = vl[1]
    enc = lambda: role.sched.exec.encoder  # noqa: E731
    img, other = random_image(112, 112, 5), random_image(112, 112, 6)
    first = _req(vl, f"see {VISION} and then tell me more about it", [img])
    _run(vl, [first])
    encoded = enc().images_encoded
    again = _req(vl, f"see {VISION} and then tell me more about it, twice", [img])
    (tokens, out), = _run(vl, [again]).values()
    assert out.cached_tokens >= len(first.input_ids) // 8 * 8 - 8  # the first prompt's pages, its image's among them
    assert enc().images_encoded == encoded
    assert tokens == _hf(vl, again, [img])
    diff = _req(vl, f"see {VISION} and then tell me more about it", [other])
    (_, out), = _run(vl, [diff]).values()
    assert out.cached_tokens <= diff.images[0].offset  # the text before the image only
    assert enc().images_encoded == encoded + 1
    role.kv.flush()
    assert role.kv.all_free()
