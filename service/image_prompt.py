"""Images in a prompt, between parsing and the worker (vision-language models; docs/architecture.md "Images").

service/protocol.py finds each image's place: the chat template (or /generate's text) puts one image token
per image; `locate` records where (ParsedRequest.image_at) and the URLs in order. The frontend then loads and
preprocesses the images off the event loop (service/images.py) and `expand` replaces each single image
token by the image's `tokens` copies, checks the longer prompt against the context length, fits max tokens
again and attaches the images (engine.request_groups.ImageInput) to the GenerateReq. The worker writes each
span's pad value over it (engine.extras.multimodal).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from engine.request_groups import ImageInput
from service.parsed import Limits, ParsedRequest, RequestError


def no_images(what: str) -> RequestError:
    return RequestError(f"{what}: this model does not take images (it is a text-only model)")


def locate(parsed: ParsedRequest, urls: list[str], limits: Limits) -> None:
    """Record the image token of each of `urls` in parsed.req.input_ids (one each, in order) or raise."""
    assert limits.image_tokens is not None
    image = limits.image_tokens[1]
    n_prompt = len(parsed.req.input_ids) - parsed.req.resumed_tokens  # a resumed stream's output follows
    at = [i for i, t in enumerate(parsed.req.input_ids[:n_prompt]) if t == image]
    if len(at) != len(urls):
        raise RequestError(f"the prompt has {len(at)} image placeholders for {len(urls)} images; give one "
                           f"placeholder per image, in order")
    start = limits.image_tokens[0]
    if any(i == 0 or parsed.req.input_ids[i - 1] != start for i in at):
        raise RequestError("each image placeholder (the image token) must follow the vision start token, as the "
                           "model's chat template writes them")
    parsed.image_urls, parsed.image_at = list(urls), at


def with_placeholders(ids: list[int], images: int, limits: Limits) -> list[int]:
    """/generate: `ids` as given when they hold image tokens; else one placeholder per image put before them."""
    assert limits.image_tokens is not None
    start, image, end = limits.image_tokens
    if image in ids:
        return ids
    return [start, image, end] * images + ids


def expand(parsed: ParsedRequest, processed: list[Any], limits: Limits) -> None:
    """Each image token of parsed.req becomes its image's tokens; the images go into the request.
    `processed`: service.images.ProcessedImage in the order of parsed.image_urls."""
    req = parsed.req
    image = limits.image_tokens[1] if limits.image_tokens else -1
    ids: list[int] = []
    inputs: list[ImageInput] = []
    prev = 0
    # no pixels to a worker that never runs the tower for them: a decode (its prefill computes every prompt with
    # images), or a prefill an encoder sends the rows (E/P/D)
    remote = req.encoder.host is not None or limits.role == "decode"
    for at, img in zip(parsed.image_at, processed):
        ids += req.input_ids[prev:at]
        pixels = img.pixel_values
        inputs.append(ImageInput(hash=img.hash, offset=len(ids), tokens=img.tokens, grid=list(img.grid_thw),
                                 pixels=b"" if remote else pixels.tobytes(), dim=int(pixels.shape[1])))
        ids += [image] * img.tokens
        prev = at + 1
    ids += req.input_ids[prev:]
    ctx = limits.context_length
    if len(ids) >= ctx:
        raise RequestError(f"the prompt has {len(ids)} tokens ({sum(x.tokens for x in inputs)} of them for "
                           f"{len(inputs)} images); this model's context length is {ctx} (prompt + output), so "
                           f"at most {ctx - 1} prompt tokens fit")
    parsed.req = dataclasses.replace(req, input_ids=ids, sampling=req.sampling.within(ctx - len(ids)), images=inputs)
