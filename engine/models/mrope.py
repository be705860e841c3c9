"""M-RoPE positions of a vision-language prompt (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): int64 [3, T], rows t, h, w.

transformers' `get_rope_index` for images, step by step: a text token at sequence index i after the
running position `cur` gets cur on all three rows, and cur advances by one. An image of grid (t, h, w)
(patches; m = spatial_merge_size) is a run of t * (h/m) * (w/m) image tokens in (t, h/m, w/m) raster order;
its token at (a, b, c) gets (cur + a, cur + b, cur + c), and cur then advances by max(h, w) / m (not by the
run's length: an image takes fewer positions than tokens). The prompt's `delta` = max position + 1 - len:
after the prompt, the token at cache position p (p >= len) has position p + delta on all three rows.
"""

from __future__ import annotations

import torch

from engine.config import ModelConfig


def image_spans(ids: list[int], cfg: ModelConfig) -> list[tuple[int, int]]:
    """(start, end) of every run of cfg.image_token_id in `ids`, in order."""
    spans, i, n = [], 0, len(ids)
    image = cfg.image_token_id
    while i < n:
        if ids[i] == image:
            j = i
            while j < n and ids[j] == image:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def image_tokens(grid: tuple[int, int, int], merge: int) -> int:
    """Image tokens of an image of `grid` (t, h, w) patches: t * h * w / merge**2."""
    t, h, w = grid
    return t * (h // merge) * (w // merge)


def positions_3d(ids: list[int], grids: list[tuple[int, int, int]], cfg: ModelConfig) -> tuple[torch.Tensor, int]:
    """(int64 [3, len(ids)] positions, delta) of a prompt whose image-token runs (each preceded by
    cfg.vision_start_token_id) correspond in order to `grids` ((t, h, w) patches per image, as the image
    processor's image_grid_thw). No images: arange on every row, delta 0. ValueError naming the mismatch when
    the runs and the grids do not correspond (count, a run's length, a missing vision_start, a grid not
    divisible by the merge size)."""
    n = len(ids)
    spans = image_spans(ids, cfg) if cfg.image_token_id >= 0 else []
    if len(spans) != len(grids):
        raise ValueError(f"the prompt has {len(spans)} image token runs but {len(grids)} images were given")
    m = cfg.spatial_merge_size
    if not spans:
        return torch.arange(n, dtype=torch.int64).expand(3, n).clone(), 0
    out = torch.empty(3, n, dtype=torch.int64)
    cur, prev = 0, 0
    for k, ((start, end), grid) in enumerate(zip(spans, grids)):
        t, h, w = (int(v) for v in grid)
        if min(t, h, w) < 1 or h % m or w % m:
            raise ValueError(f"image {k}: grid {(t, h, w)} is not t, h, w >= 1 with h and w divisible by the "
                             f"spatial_merge_size {m}")
        if start == 0 or ids[start - 1] != cfg.vision_start_token_id:
            raise ValueError(f"image {k}: its image token run at {start} is not preceded by the vision_start token "
                             f"{cfg.vision_start_token_id}")
        want = image_tokens((t, h, w), m)
        if end - start != want:
            raise ValueError(f"image {k}: its run has {end - start} image tokens but its grid {(t, h, w)} makes "
                             f"{want} (t*h*w / {m}**2)")
        out[:, prev:start] = torch.arange(cur, cur + start - prev)  # the text before it
        cur += start - prev
        lh, lw = h // m, w // m
        out[0, start:end] = (cur + torch.arange(t)).repeat_interleave(lh * lw)
        out[1, start:end] = (cur + torch.arange(lh)).repeat_interleave(lw).repeat(t)
        out[2, start:end] = (cur + torch.arange(lw)).repeat(t * lh)
        cur += max(h, w) // m
        prev = end
    out[:, prev:] = torch.arange(cur, cur + n - prev)
    return out, int(out.max()) + 1 - n


def decode_positions(cache_positions: torch.Tensor, delta: int) -> torch.Tensor:
    """int64 [3, T] M-RoPE positions of tokens after the prompt at `cache_positions` (int64 [T]): p + delta
    on every row."""
    return (cache_positions + delta).expand(3, -1)
