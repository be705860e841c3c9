"""Images in a prompt (vision-language models: engine/models/qwen2_5_vl.py, qwen3_vl.py).

A request's images (`Multimodal`, from its message's ImageInput list: service/images.py prepared them) each
own a span of the prompt: `tokens` positions from `offset`. In the request's token ids that span holds the
image's pad value (`pad_value`: derived from its content hash, at or above 2**31, past every vocabulary), so
the prefix cache (and the KV events' block hashes) tell images apart: the same image in a later turn matches,
a different image of the same size never does. The model never reads those ids: a prompt chunk covering
image rows replaces their embeddings with the vision tower's output (`InputEmbeds`, the same extra that
`input_embeds` requests use), adds the deepstack features where the model has them (`Deepstack`), and gives
every row its 3-D M-RoPE position (`Rope3`). After the prompt, cache position p runs at p + delta on all three
axes (a decode on another worker computes the same delta from the same images: it never needs their pixels).

`Encoder` runs the tower for the images a step's prompt chunks need that are not yet encoded, several images
in one call, and keeps the outputs by hash (LRU, bounded by bytes): a repeated image skips the tower.

E/P/D (`pdserve encoder`): the tower's rows move from an encoder to a prefill as pages of a `RowPool` over the
transfer plane, as KV pages move to a decode (engine side: `RowPool.put` on the encoder, `RowPool.take` on the
prefill; the rooms: encoder_service/worker.py, prefill_service/worker.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.kvcache.memory import PageAllocator
from engine.models.mrope import positions_3d
from engine.request_groups import ImageInput

PAD_BASE = 1 << 31  # pad values lie in [2**31, 2**32): past any vocabulary, within the KV events' be32 ids


def pad_value(digest: bytes) -> int:
    """The id an image's span carries in the token ids (the prefix cache's key), from its content hash."""
    return PAD_BASE | (int.from_bytes(digest[:4], "big") & (PAD_BASE - 1))


@dataclass
class Image:
    hash: bytes
    offset: int
    tokens: int
    grid: tuple[int, int, int]
    pixels: torch.Tensor | None  # float32 [P, D]; None on a decode, or once the prompt is computed
    features: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (embeds [tokens, H], deepstack [k, tokens, H])


@dataclass
class Multimodal:
    """A request's images and its M-RoPE positions (built on first use, from the model's config)."""

    images: list[Image]
    positions: torch.Tensor | None = None  # int64 [3, prompt length]
    delta: int = 0  # after the prompt: rope position = cache position + delta

    def bind(self, ids: list[int], cfg: Any) -> None:
        """Compute the prompt's 3-D positions (engine.models.mrope) for a model config `cfg`."""
        rope_ids = list(ids)
        for im in self.images:
            rope_ids[im.offset : im.offset + im.tokens] = [cfg.image_token_id] * im.tokens
        self.positions, self.delta = positions_3d(rope_ids, [im.grid for im in self.images], cfg)

    def release(self) -> None:
        """The prompt is computed: drop the pixels and the tower's outputs (the Encoder's cache keeps these)."""
        for im in self.images:
            im.pixels, im.features = None, None


def attach(token_ids: list[int], inputs: list[ImageInput]) -> Multimodal:
    """The request's images from its message; writes each image's pad value over its span of `token_ids`."""
    images = []
    for x in inputs:
        pixels = None
        if x.pixels:
            pixels = torch.frombuffer(bytearray(x.pixels), dtype=torch.float32).view(-1, x.dim)
        images.append(Image(bytes(x.hash), x.offset, x.tokens, (x.grid[0], x.grid[1], x.grid[2]), pixels))
        token_ids[x.offset : x.offset + x.tokens] = [pad_value(x.hash)] * x.tokens
    return Multimodal(images)


# ---- what a request adds to the forward batch (engine/forward/forward_batch.py: Segment.extras) ------
class _Inputs(Protocol):
    embeds: list[tuple[int, torch.Tensor]] | None
    deepstack: list[tuple[int, torch.Tensor]] | None
    rope3: list[tuple[int, torch.Tensor]] | None


@dataclass(frozen=True, slots=True)
class Rope3:
    """A segment's 3-D rope positions (int64 [3, n]): rows whose three axes differ from the cache position."""

    positions: torch.Tensor

    def add(self, batch: _Inputs, seg: int, row: int) -> None:
        if batch.rope3 is None:
            batch.rope3 = []
        batch.rope3.append((row, self.positions))


@dataclass(frozen=True, slots=True)
class ImageRows:
    """The tower's output for some rows of a prompt chunk: (offset in the segment, embeds [n, H],
    deepstack [k, n, H] or None) per image piece."""

    pieces: tuple[tuple[int, torch.Tensor, torch.Tensor | None], ...]

    def add(self, batch: _Inputs, seg: int, row: int) -> None:
        if batch.embeds is None:
            batch.embeds = []
        for off, emb, deep in self.pieces:
            batch.embeds.append((row + off, emb))
            if deep is not None:
                if batch.deepstack is None:
                    batch.deepstack = []
                batch.deepstack.append((row + off, deep))


def rope_rows(mm: Multimodal, start: int, n: int) -> torch.Tensor:
    """int64 [3, n]: the rope positions of cache positions start .. start + n - 1."""
    assert mm.positions is not None
    total = mm.positions.shape[1]
    if start + n <= total:
        return mm.positions[:, start : start + n]
    tail = torch.arange(max(start, total), start + n, dtype=torch.long) + mm.delta
    head = mm.positions[:, start:total] if start < total else mm.positions[:, :0]
    return torch.cat([head, tail.unsqueeze(0).expand(3, -1)], dim=1)


def prepare(mm: Multimodal, start: int, n: int, prompt: bool) -> tuple[Rope3 | ImageRows, ...]:
    """What the segment of tokens [start, start + n) adds: its rope positions and, in a prompt chunk, the
    tower's rows of the images it covers (encoded before: Encoder.encode)."""
    if not prompt and mm.delta == 0:
        return ()  # a text position on all three axes: what the batch gives by default
    extras: tuple[Rope3 | ImageRows, ...] = (Rope3(rope_rows(mm, start, n)),)
    if prompt:
        pieces = []
        for im in mm.images:
            a, b = max(start, im.offset), min(start + n, im.offset + im.tokens)
            if a >= b:
                continue
            assert im.features is not None, "image rows in a chunk before the tower ran"
            emb, deep = im.features
            lo, hi = a - im.offset, b - im.offset
            pieces.append((a - start, emb[lo:hi], None if deep is None else deep[:, lo:hi]))
        if pieces:
            extras += (ImageRows(tuple(pieces)),)
    return extras


# ---- the vision tower, with its cache by content hash ------------------------------------------------------
class VisionModel(Protocol):
    def encode_images(self, pixel_values: torch.Tensor,
                      grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class Encoder:
    """Runs the model's vision tower for the images a step needs; keeps outputs by image hash (LRU,
    at most `cache_bytes`; 0 = keep none beyond the request that asked)."""

    def __init__(self, model: VisionModel, device: torch.device | str, dtype: torch.dtype, cache_bytes: int) -> None:
        self.model, self.device, self.dtype = model, device, dtype
        self.cache_bytes = cache_bytes
        self.cache: OrderedDict[bytes, tuple[torch.Tensor, torch.Tensor | None]] = OrderedDict()
        self.cached_bytes = 0
        self.images_encoded = 0  # images the tower ran for
        self.cache_hits = 0  # images whose output came from the cache

    def encode(self, needed: Iterable[Image]) -> None:
        """Fill `features` of every image given (cache first; the rest in one tower call)."""
        todo: list[Image] = []
        for im in needed:
            if im.features is not None:
                continue
            hit = self.cache.get(im.hash)
            if hit is not None:
                self.cache.move_to_end(im.hash)
                im.features = hit
                self.cache_hits += 1
            elif any(t.hash == im.hash for t in todo):
                continue  # the same image twice in this step: encoded once, below
            else:
                if im.pixels is None:
                    raise ValueError("an image's rows are needed but its pixels were not sent (a decode never "
                                     "computes a prompt)")
                todo.append(im)
        if todo:
            self._run(todo)
        for im in needed:  # duplicates of an image encoded just now
            if im.features is None:
                im.features = self.cache.get(im.hash) or next(t.features for t in todo if t.hash == im.hash)

    @torch.inference_mode()
    def _run(self, todo: list[Image]) -> None:
        pixels = torch.cat([im.pixels for im in todo]).to(device=self.device, dtype=self.dtype)  # type: ignore[misc]
        grids = torch.tensor([im.grid for im in todo], dtype=torch.long, device=self.device)
        emb, deep = self.model.encode_images(pixels, grids)
        row = 0
        for im in todo:
            e = emb[row : row + im.tokens]
            d = None if deep is None else deep[:, row : row + im.tokens]
            if e.shape[0] != im.tokens:
                raise ValueError(f"the vision tower gave {e.shape[0]} rows for an image of {im.tokens} tokens")
            im.features = (e, d)
            row += im.tokens
            self._keep(im.hash, im.features)
        self.images_encoded += len(todo)

    def _keep(self, key: bytes, feats: tuple[torch.Tensor, torch.Tensor | None]) -> None:
        size = sum(t.numel() * t.element_size() for t in feats if t is not None)
        if size > self.cache_bytes:
            return
        self.cache[key] = feats
        self.cached_bytes += size
        while self.cached_bytes > self.cache_bytes:
            _, old = self.cache.popitem(last=False)
            self.cached_bytes -= sum(t.numel() * t.element_size() for t in old if t is not None)

    def stats(self) -> dict[str, int]:
        return {"images_encoded": self.images_encoded, "image_cache_hits": self.cache_hits,
                "image_cache_entries": len(self.cache), "image_cache_bytes": self.cached_bytes}


def needed(mm: Multimodal, start: int, n: int) -> list[Image]:
    """The images whose spans meet tokens [start, start + n)."""
    return [im for im in mm.images if im.offset < start + n and start < im.offset + im.tokens]


class RowPool:
    """Pages of image-embedding rows, the unit an encoder sends a prefill: buffer [P, 1 + k, page_rows, H] (the
    tower's output, then its k deepstack feature sets) in the model's dtype, page-major like a KV pool, with a
    page allocator. `put` packs a request's images' rows into fresh pages, `take` reads them back per image."""

    def __init__(self, rows: int, layers: int, hidden: int, dtype: torch.dtype, device: torch.device | str,
                 page_rows: int = 16) -> None:
        self.page_rows, self.layers, self.hidden = page_rows, layers, hidden
        num = max(-(-rows // page_rows), 1)
        self.buffer = torch.zeros((num, layers, page_rows, hidden), dtype=dtype, device=device)
        self.allocator = PageAllocator(num)

    def pages_for(self, rows: int) -> int:
        return -(-rows // self.page_rows)

    def can_hold(self, rows: int) -> bool:
        return self.allocator.can_allocate(self.pages_for(rows))

    def put(self, features: list[tuple[torch.Tensor, torch.Tensor | None]]) -> list[int]:
        """Fresh pages holding these images' rows back to back (MemoryError when they do not fit)."""
        rows = torch.cat([self._stack(e, d) for e, d in features], dim=1)  # [1 + k, N, H]
        pages = self.allocator.allocate(self.pages_for(rows.shape[1]))
        for i, p in enumerate(pages):
            part = rows[:, i * self.page_rows : (i + 1) * self.page_rows]
            self.buffer[p, :, : part.shape[1]] = part
        return pages

    def take(self, pages: list[int], counts: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The rows of `pages` split into images of `counts` rows: (embeds [n, H], deepstack [k, n, H] or None),
        copies (the pages may be freed after)."""
        rows = self.buffer[pages].transpose(0, 1).reshape(self.layers, -1, self.hidden)  # [1 + k, pages * rows, H]
        out, at = [], 0
        for n in counts:
            part = rows[:, at : at + n].clone()
            out.append((part[0], part[1:] if self.layers > 1 else None))
            at += n
        return out

    def free(self, pages: list[int]) -> None:
        self.allocator.free(pages)

    def _stack(self, emb: torch.Tensor, deep: torch.Tensor | None) -> torch.Tensor:
        if (0 if deep is None else deep.shape[0]) != self.layers - 1:
            raise ValueError(f"an image's rows carry {0 if deep is None else deep.shape[0]} deepstack sets, this pool "
                             f"{self.layers - 1}")
        return emb.unsqueeze(0) if deep is None else torch.cat([emb.unsqueeze(0), deep])
