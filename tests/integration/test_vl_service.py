"""Vision-language models served (issue 50): images in OpenAI chat content parts and /generate's
`image_data`, through the real services on a tiny random-weight Qwen2.5-VL (tests/vl_models.py): colocated;
prefill + decode over UCX behind a router (the prefill runs the tower); and encoder + prefill + decode behind
a second router (E/P/D: the encoder runs the tower and sends the rows to the prefill over UCX). transformers,
with its own PIL image processor, is the oracle; PD and E/P/D through their routers must equal colocated; the
same image twice hits the prefix cache and runs the tower once; bad images are 400s that leave nothing behind.
"""

from __future__ import annotations

import base64
import sys

import pytest
import torch
from PIL import Image

from tests.pd_harness import integration_helpers, router_stack
from tests.vl_models import data_url, random_image, write_qwen2_5_vl

integration_helpers()
from pd_harness import call, info  # noqa: E402 (tests/integration's harness, made importable above)
from router_harness import Proc, free_port, start_router, wait_for  # noqa: E402

pytestmark = pytest.mark.slow
TOKENS = 16
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def vl(tmp_path_factory):  # noqa: ANN001, ANN201
    """colo, pre, dec, router (P/D) from router_stack; plus an encoder "enc" and a router "epd" over E, P, D."""
    model = tmp_path_factory.mktemp("qwen2_5_vl")
    write_qwen2_5_vl(model)
    with router_stack(model) as procs:
        port, boot = free_port(), free_port()
        procs["enc"] = Proc(f"encoder-{port}", [sys.executable, "-m", "pdserve", "encoder", "--model", str(model),
                                                "--port", str(port), "--bootstrap-port", str(boot), "--device", "cpu",
                                                "--threads", "1", "--heartbeat-interval", "30", "--log-level",
                                                "warning"], f"http://127.0.0.1:{port}")
        procs["enc"].wait_healthy(300)
        procs["epd"] = start_router(["--prefill", procs["pre"].url, "--decode", procs["dec"].url,
                                     "--encoder", f"{procs['enc'].url},bootstrap_port={boot}"])
        procs["epd"].wait_healthy(60)
        yield model, procs


@pytest.fixture(scope="module")
def oracle(vl):  # noqa: ANN001, ANN201
    """transformers' model, tokenizer and PIL image processor over the same directory."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model, _ = vl
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(model, torch_dtype=torch.float32).eval()
    return hf, AutoTokenizer.from_pretrained(model), Qwen2VLImageProcessorPil.from_pretrained(model)


def _hf_greedy(oracle, text: str, images: list[Image.Image]) -> list[int]:  # noqa: ANN001
    """transformers' 16 greedy tokens for `text` whose image placeholders stand for `images` in order."""
    hf, tok, proc = oracle
    ids = tok.encode(text, add_special_tokens=False)
    pix = proc(images=images, return_tensors="pt")
    merge = proc.merge_size ** 2
    pad = hf.config.image_token_id
    out: list[int] = []
    counts = iter((pix["image_grid_thw"].prod(-1) // merge).tolist())
    for t in ids:
        out += [pad] * next(counts) if t == pad else [t]
    with torch.no_grad():
        x = torch.tensor([out])
        gen = hf.generate(x, pixel_values=pix["pixel_values"], image_grid_thw=pix["image_grid_thw"],
                          mm_token_type_ids=(x == pad).int(),  # transformers 5's M-RoPE reads the image rows here
                          max_new_tokens=TOKENS, do_sample=False, min_new_tokens=TOKENS)
    return gen[0, len(out):].tolist()


def _generate(url: str, text: str, images: list[Image.Image], **extra) -> tuple[int, dict]:  # noqa: ANN003
    body = {"text": text, "image_data": [data_url(i) for i in images],
            "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0, "ignore_eos": True}, **extra}
    return call(url, "/generate", body)


@pytest.mark.parametrize("sizes", [[(56, 84)], [(84, 56), (112, 56)]], ids=["one", "two"])
def test_generate_with_images_matches_transformers_and_pd_equals_colocated(vl, oracle, sizes):
    _, procs = vl
    images = [random_image(w, h, i) for i, (w, h) in enumerate(sizes)]
    text = "look: " + " and ".join([VISION] * len(images)) + " what is it?"
    want = _hf_greedy(oracle, text, images)
    status, colo = _generate(procs["colo"].url, text, images)
    assert status == 200, colo
    assert colo["output_ids"] == want
    for router in ("router", "epd"):  # P/D, the prefill running the tower; E/P/D, the encoder running it
        status, pd = _generate(procs[router].url, text, images)
        assert status == 200, (router, pd)
        assert pd["output_ids"] == want, router


def test_epd_runs_the_tower_on_the_encoder_and_text_skips_it(vl):
    _, procs = vl
    enc, pre = info(procs["enc"])["counters"], info(procs["pre"])["counters"]
    img = random_image(84, 84, 21)
    status, out = _generate(procs["epd"].url, f"a new image {VISION} here", [img])
    assert status == 200, out
    assert info(procs["enc"])["counters"]["images_encoded"] == enc.get("images_encoded", 0) + 1
    assert info(procs["pre"])["counters"].get("images_encoded", 0) == pre.get("images_encoded", 0)  # not here
    before = info(procs["enc"])["counters"]["images_encoded"]
    status, out = call(procs["epd"].url, "/generate", {"text": "text only", "sampling_params": {"max_new_tokens": 3}})
    assert status == 200, out
    assert info(procs["enc"])["counters"]["images_encoded"] == before
    _idle(procs["enc"])  # the image request's room ends once the prefill's ack reaches the encoder


def test_chat_image_parts_through_router_equal_colocated(vl):
    _, procs = vl
    url = data_url(random_image(56, 56, 5))
    parts = [{"type": "text", "text": "what is in"}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "?"}]
    body = {"model": "m", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": parts}]}
    status, colo = call(procs["colo"].url, "/v1/chat/completions", body)
    assert status == 200, colo
    for router in ("router", "epd"):
        status, pd = call(procs[router].url, "/v1/chat/completions", body)
        assert status == 200, (router, pd)
        assert pd["choices"][0]["message"]["content"] == colo["choices"][0]["message"]["content"], router
    assert colo["usage"]["prompt_tokens"] > 4  # (56 / 28)**2 image tokens plus the template's
    streamed = dict(body, stream=True)  # the same through E/P/D, streamed
    status, events = call(procs["epd"].url, "/v1/chat/completions", streamed)
    assert status == 200, events
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    assert text == colo["choices"][0]["message"]["content"]


def test_a_repeated_image_hits_the_cache_and_skips_the_tower(vl):
    _, procs = vl
    url, colo = procs["colo"].url, procs["colo"]
    img, other = random_image(112, 112, 11), random_image(112, 112, 12)  # one size: as many image tokens
    text = f"first {VISION} then some words after the image"
    before = info(colo)["counters"].get("images_encoded", 0)
    status, a = _generate(url, text, [img])
    assert status == 200, a
    assert info(colo)["counters"]["images_encoded"] == before + 1
    status, b = _generate(url, text + " and a second turn", [img])
    assert status == 200, b
    tokens = a["meta_info"]["prompt_tokens"]
    assert b["meta_info"]["cached_tokens"] >= tokens - 16  # every page of the first prompt, image included
    assert info(colo)["counters"]["images_encoded"] == before + 1  # no tower run
    status, c = _generate(url, text, [other])
    assert status == 200, c
    assert c["meta_info"]["cached_tokens"] < 8  # the text before the image only: the image differs
    assert info(colo)["counters"]["images_encoded"] == before + 2


def _idle(proc) -> None:  # noqa: ANN001
    """Wait until the worker holds no request and no KV (or image rows): nothing was left behind."""
    def idle() -> bool:
        state = info(proc)
        return not any(state["queues"].values()) and state["kv_used_tokens"] == 0

    wait_for(idle, 60, f"{proc.name} idle")


BAD = {
    "undecodable": ("data:image/png;base64," + base64.b64encode(b"not a png").decode(), "image 0"),
    "bad base64": ("data:image/png;base64,@@@", "image 0"),
    "http refused": ("http://127.0.0.1:9/x.png", "--image-url-fetch"),
    "file refused": ("file:///etc/passwd", "--image-dir"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_images_are_400s(vl, case):
    _, procs = vl
    url, words = BAD[case]
    for where in ("colo", "router", "epd"):
        status, body = call(procs[where].url, "/generate", {"text": f"x {VISION}", "image_data": [url],
                                                             "sampling_params": {"max_new_tokens": 2}})
        assert status == 400, body
        assert words in str(body)
    for where in ("colo", "enc"):
        _idle(procs[where])


def test_too_many_images_and_mismatched_placeholders_are_400s(vl):
    _, procs = vl
    small = data_url(random_image(28, 28, 1))
    status, body = call(procs["colo"].url, "/generate", {"text": "x", "image_data": [small] * 9})
    assert status == 400 and "9 images" in str(body), body
    status, body = call(procs["colo"].url, "/generate", {"text": f"{VISION} {VISION}", "image_data": [small]})
    assert status == 400 and "2 image placeholders for 1 images" in str(body), body


def test_images_compose_with_n_logprobs_and_grammars(vl):
    _, procs = vl
    img = random_image(56, 84, 31)
    body = {"text": f"{VISION} answer yes or no:", "image_data": [data_url(img)], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "n": 2, "regex": "(yes|no)[.!]"}}
    status, colo = call(procs["colo"].url, "/generate", body)
    assert status == 200, colo
    assert len(colo) == 2 and all(c["text"] in ("yes.", "yes!", "no.", "no!") for c in colo)
    for router in ("router", "epd"):
        status, got = call(procs[router].url, "/generate", body)
        assert status == 200, (router, got)
        assert [c["output_ids"] for c in got] == [c["output_ids"] for c in colo], router
        lp = [x[0] for x in got[0]["meta_info"]["output_token_logprobs"]]
        assert lp == pytest.approx([x[0] for x in colo[0]["meta_info"]["output_token_logprobs"]], abs=1e-4)
