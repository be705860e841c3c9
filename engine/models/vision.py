"""The vision-language families' shared parts: the Qwen2.5-VL and Qwen3-VL vision towers, their config parsing,
and `VisionLanguageLM`, the text decoder (layers.CausalLM) with M-RoPE positions, input embeddings and
Qwen3-VL's deepstack features. transformers' math (modeling_qwen2_5_vl.py, modeling_qwen3_vl.py, 5.x), plain
torch.

Pixels: the image processor's `pixel_values` [P, C * Tp * p * p] (one row per patch: channels, temporal patch,
rows, columns) and `image_grid_thw` [n, 3] (t, h, w patches per image; h and w multiples of the merge size m),
images concatenated in order. Inside one image the patches come in merge-block order: for every m x m block
(block rows, then block columns) its m * m patches, so m * m consecutive rows merge into one output token.

Tower (both): the patch embedding (the processor's Conv3d with kernel = stride = the patch, so one linear over
the flattened patch), a 2-D rotary over each head (the first half of the head's frequencies rotate by the
patch's row, the second by its column: head_dim / 4 frequencies each, theta 10000 unless the config says),
pre-norm blocks of non-causal self-attention within each image frame, then the merger: the m * m rows of a
block concatenated, through an MLP, into one token of the text model's hidden size.
- Qwen2.5-VL: RMSNorm, SwiGLU MLP with biases, window attention: the blocks listed in fullatt_block_indexes
  attend over the whole frame, the others within windows of window_size / m / patch_size merged tokens per
  side. The sequence is permuted once so each window is contiguous (window_index, in merge units) and the
  merged output is put back in image order with the inverse permutation.
- Qwen3-VL: LayerNorm, GELU (tanh) MLP with biases, learned absolute position embeddings on a square grid
  bilinearly resampled (align_corners) to each image's patch grid and added after the patch embedding; after
  each block listed in deepstack_visual_indexes a "deepstack" merger (LayerNorm after the m * m concatenation)
  gives one more feature set, which the text model adds to the image rows' hidden states after its first
  decoder layers (feature set i after decoder layer i).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import Checkpoint, attention_weights, dense_mlp_weights, shell_weights
from engine.models.layers import CausalLM, ForwardContext, RMSNorm, RotaryTables, dense_mlp, embedding
from engine.models.rope import mrope_rows

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


@dataclass(frozen=True)
class VisionSpec:
    """A vision tower's shape, from config.json's vision_config (transformers' defaults where a field is absent)."""

    kind: str  # qwen2_5_vl | qwen3_vl
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    hidden_act: str
    rope_theta: float
    window_size: int = 0  # Qwen2.5-VL
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL
    num_position_embeddings: int = 0  # Qwen3-VL
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2


_VISION_DEFAULTS = {
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       out_hidden_size=3584, fullatt_block_indexes=[7, 15, 23, 31]),
    "qwen3_vl": dict(depth=27, hidden_size=1152, hidden_act="gelu_pytorch_tanh", intermediate_size=4304,
                     num_heads=16, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                     out_hidden_size=3584, num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24]),
}


def vision_spec(raw: object, kind: str) -> VisionSpec:
    """The vision_config dict `raw` of a `kind` model; ValueError naming a field it cannot run exactly."""
    if not isinstance(raw, dict):
        raise ValueError(f"config.json field 'vision_config' must be an object, got {raw!r}")
    d = _VISION_DEFAULTS[kind]
    raw = dict(raw)
    if "in_channels" not in raw and "in_chans" in raw:  # the hub's older name
        raw["in_channels"] = raw["in_chans"]

    def num(key: str) -> int:
        v = raw.get(key, d.get(key))
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"config.json field 'vision_config.{key}' must be a positive integer, got {v!r}")
        return v

    def indexes(key: str, depth: int) -> tuple[int, ...]:
        v = raw.get(key, d.get(key))
        if not isinstance(v, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < depth
                                                   for i in v) or len(set(v)) != len(v):
            raise ValueError(f"config.json field 'vision_config.{key}' must list distinct block indexes below the "
                             f"depth {depth}, got {v!r}")
        return tuple(v)

    act = raw.get("hidden_act", d["hidden_act"])
    if act not in ACTIVATIONS:
        raise ValueError(f"config.json field 'vision_config.hidden_act' ({act!r}) is not supported; supported: "
                         f"{', '.join(ACTIVATIONS)}")
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "axial")) not in ("axial", "default"):
        raise ValueError(f"config.json field 'vision_config.rope_parameters.rope_type' ({rope.get('rope_type')!r}) "
                         "is not supported (only the axial 2-D rope)")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    depth, hidden, heads = num("depth"), num("hidden_size"), num("num_heads")
    if hidden % heads or (hidden // heads) % 4:
        raise ValueError(f"config.json field 'vision_config.num_heads' ({heads}) must divide hidden_size ({hidden}) "
                         "into heads of a multiple of 4 dims")
    fields = dict(kind=kind, depth=depth, hidden_size=hidden, intermediate_size=num("intermediate_size"),
                  num_heads=heads, in_channels=num("in_channels"), patch_size=num("patch_size"),
                  temporal_patch_size=num("temporal_patch_size"), spatial_merge_size=num("spatial_merge_size"),
                  out_hidden_size=num("out_hidden_size"), hidden_act=act, rope_theta=float(theta))
    if kind == "qwen2_5_vl":
        fields |= dict(window_size=num("window_size"), fullatt_block_indexes=indexes("fullatt_block_indexes", depth))
        if fields["window_size"] // fields["spatial_merge_size"] // fields["patch_size"] < 1:
            raise ValueError(f"config.json field 'vision_config.window_size' ({fields['window_size']}) must be at "
                             "least spatial_merge_size * patch_size")
    else:
        n = num("num_position_embeddings")
        if int(n ** 0.5) ** 2 != n:
            raise ValueError(f"config.json field 'vision_config.num_position_embeddings' ({n}) must be a square")
        fields |= dict(num_position_embeddings=n,
                       deepstack_visual_indexes=indexes("deepstack_visual_indexes", depth))
    return VisionSpec(**fields)


def vl_config(raw: dict, kind: str, *, theta: float, section: list[int], interleaved: bool, tie: bool,
              defaults: dict, **fields: object) -> ModelConfig:
    """A vision-language config.json -> ModelConfig: the text model's fields from `text_config` when nested
    (transformers 5, Qwen3-VL) else from the top level (the Qwen2.5-VL hub layout); the M-RoPE section out of
    rope_scaling / rope_parameters ("mrope" is the default rope); the vision_config whole. theta, section and
    `defaults` (text fields): transformers' defaults of the family where the config omits them. `fields` go to
    from_hf."""
    if raw.get("model_type") != kind:
        raise ValueError(f"config.json field 'model_type' ({raw.get('model_type')!r}) is not {kind}")
    nested = raw.get("text_config")
    if nested is not None and not isinstance(nested, dict):
        raise ValueError(f"config.json field 'text_config' must be an object, got {nested!r}")
    src = raw if nested is None else nested
    text = {k: v for k, v in (raw | src).items() if k not in ("text_config", "vision_config")}
    rope = src.get("rope_scaling") or src.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ValueError(f"config.json field 'rope_scaling' must be an object, got {rope!r}")
    rope = dict(rope)
    sec = rope.pop("mrope_section", section)
    rope.pop("mrope_interleaved", None)  # transformers 5 reads the layout from the family, not from this flag
    old_type = rope.pop("type", "default")  # the hub's {"type": "mrope"}; transformers 5 adds rope_type
    rope_kind = rope.pop("rope_type", old_type)
    rope["rope_type"] = "default" if rope_kind == "mrope" else rope_kind
    rope["rope_theta"] = rope.get("rope_theta", src.get("rope_theta", theta))
    for key in ("rope_scaling", "rope_theta"):
        text.pop(key, None)
    text |= {k: v for k, v in defaults.items() if k not in src} | {"rope_parameters": rope, "model_type": kind}
    act = text.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"config.json field 'hidden_act' ({act!r}) is not supported (the text MLP is SwiGLU: silu)")
    vision = raw.get("vision_config")
    spec = vision_spec({} if vision is None else vision, kind)
    cfg = ModelConfig.from_hf(text, tie_embeddings=tie, **fields)
    if not isinstance(sec, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sec):
        raise ValueError(f"config.json field 'rope_scaling.mrope_section' must list 3 counts, got {sec!r}")
    try:
        mrope_rows(cfg.head_dim // 2, tuple(sec), interleaved)
    except ValueError as e:
        raise ValueError(f"config.json field 'rope_scaling.mrope_section': {e}") from None
    if spec.out_hidden_size != cfg.hidden_size:
        raise ValueError(f"config.json field 'vision_config.out_hidden_size' ({spec.out_hidden_size}) must equal the "
                         f"text model's hidden_size ({cfg.hidden_size})")
    deepstack = len(spec.deepstack_visual_indexes)
    if deepstack > cfg.num_layers:
        raise ValueError(f"config.json field 'vision_config.deepstack_visual_indexes' lists {deepstack} feature sets "
                         f"for {cfg.num_layers} decoder layers")
    ids = {}
    for key, default in (("image_token_id", 151655), ("vision_start_token_id", 151652)):
        v = raw.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < cfg.vocab_size:
            raise ValueError(f"config.json field {key!r} must be a token id below vocab_size {cfg.vocab_size}, "
                             f"got {v!r}")
        ids[key] = v
    return dataclasses.replace(cfg, mrope_section=tuple(sec), mrope_interleaved=interleaved,
                               spatial_merge_size=spec.spatial_merge_size, vision=dict(vision or {}),
                               deepstack_layers=deepstack, **ids)


# ----------------------------------------------------------------------------------------------- tower pieces


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """int64 [N, 2]: each patch's (row, column) in its image, in the processor's merge-block order, per frame."""
    out = []
    for t, h, w in grid_thw.tolist():
        bh, bw = h // merge, w // merge
        rows = torch.arange(h).view(bh, 1, merge, 1).expand(bh, bw, merge, merge)
        cols = torch.arange(w).view(1, bw, 1, merge).expand(bh, bw, merge, merge)
        out.append(torch.stack([rows.reshape(-1), cols.reshape(-1)], dim=-1).repeat(t, 1))
    return torch.cat(out)


def frame_bounds(grid_thw: torch.Tensor) -> list[int]:
    """Cumulative patch counts of every frame (each frame attends within itself): [0, hw, 2hw, ...]."""
    bounds = [0]
    for t, h, w in grid_thw.tolist():
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def rotary_2d(positions: torch.Tensor, head_dim: int, theta: float) -> RotaryTables:
    """The tower's rotary tables [N, 1, head_dim / 2] (rotate-half layout): head_dim / 4 frequencies of the
    patch's row, then the same frequencies of its column (fp32)."""
    quarter = head_dim // 2
    inv = 1.0 / (theta ** (torch.arange(0, quarter, 2, dtype=torch.float32, device=positions.device) / quarter))
    freqs = (positions.unsqueeze(-1).float() * inv).reshape(positions.shape[0], -1)  # [N, 2 * head_dim/4]
    return RotaryTables(freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1))


class PatchEmbed(nn.Module):
    """The processor's Conv3d patchifier as one linear over the flattened patch."""

    def __init__(self, spec: VisionSpec, bias: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(spec.patch_dim, spec.hidden_size, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype).reshape(-1, w.shape[1]), w, self.proj.bias)


class VisionAttention(nn.Module):
    """Non-causal multi-head self-attention within segments (frames or windows), 2-D rotary on q and k."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.heads, self.d = spec.num_heads, spec.head_dim
        self.qkv = nn.Linear(spec.hidden_size, 3 * spec.hidden_size, bias=True)
        self.proj = nn.Linear(spec.hidden_size, spec.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, rotary: RotaryTables, bounds: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, self.d).unbind(1)
        q, k = rotary(q), rotary(k)  # fp32 inside, back to x's dtype
        out = torch.empty_like(q)
        for s, e in zip(bounds[:-1], bounds[1:]):
            out[s:e] = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                      v[s:e].transpose(0, 1)).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class GatedMLP(nn.Module):
    """Qwen2.5-VL's block MLP: down(act(gate(x)) * up(x)), with biases."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """Qwen3-VL's block MLP: fc2(act(fc1(x))), with biases."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(spec.hidden_size, spec.intermediate_size)
        self.linear_fc2 = nn.Linear(spec.intermediate_size, spec.hidden_size)
        self.act = ACTIVATIONS[spec.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x))."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        dim = spec.hidden_size
        if spec.kind == "qwen2_5_vl":
            self.norm1, self.norm2, self.mlp = RMSNorm(dim, 1e-6), RMSNorm(dim, 1e-6), GatedMLP(spec)
        else:
            self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
            self.mlp = PlainMLP(spec)
        self.attn = VisionAttention(spec)

    def forward(self, x: torch.Tensor, rotary: RotaryTables, bounds: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rotary, bounds)
        return x + self.mlp(self.norm2(x))


class Qwen25Merger(nn.Module):
    """RMSNorm per patch, m * m patches concatenated, Linear -> GELU -> Linear (HF names ln_q, mlp.0, mlp.2)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        wide = spec.hidden_size * spec.spatial_merge_size ** 2
        self.ln_q = RMSNorm(spec.hidden_size, 1e-6)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, spec.out_hidden_size))
        self.wide = wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.wide))


class Qwen3Merger(nn.Module):
    """LayerNorm per patch (or, `postshuffle`, over the m * m concatenation), Linear -> GELU -> Linear."""

    def __init__(self, spec: VisionSpec, postshuffle: bool) -> None:
        super().__init__()
        self.wide = wide = spec.hidden_size * spec.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(wide if postshuffle else spec.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(wide, wide)
        self.linear_fc2 = nn.Linear(wide, spec.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.wide)) if self.postshuffle else self.norm(x).reshape(-1, self.wide)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def window_order(grid_thw: torch.Tensor, spec: VisionSpec) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: (the merged tokens' order that makes every window contiguous, int64 [N / m^2];
    the windows' cumulative patch bounds). Windows are side x side merged tokens (side = window_size / m /
    patch_size) tiling each frame from its top-left corner (the last row and column of windows may be smaller);
    frames, then window rows, then window columns, row-major inside a window."""
    m = spec.spatial_merge_size
    side = spec.window_size // m // spec.patch_size
    order, bounds, base = [], [0], 0
    for t, h, w in grid_thw.tolist():
        lh, lw = h // m, w // m
        grid = torch.arange(t * lh * lw).view(t, lh, lw) + base
        for f in range(t):
            for r in range(0, lh, side):
                for c in range(0, lw, side):
                    win = grid[f, r : r + side, c : c + side].reshape(-1)
                    order.append(win)
                    bounds.append(bounds[-1] + win.numel() * m * m)
        base += t * lh * lw
    return torch.cat(order), bounds


class Qwen25VisionTower(nn.Module):
    """Qwen2.5-VL's vision transformer (HF names: patch_embed.proj, blocks.N.{norm1, attn.{qkv, proj}, norm2,
    mlp.{gate,up,down}_proj}, merger.{ln_q, mlp.0, mlp.2})."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = Qwen25Merger(spec)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, None]:
        spec, unit = self.spec, self.spec.spatial_merge_size ** 2
        x = self.patch_embed(pixels)
        n = x.shape[0]
        order, windows = window_order(grid_thw, spec)
        order = order.to(x.device)
        frames = frame_bounds(grid_thw)

        def permute(t: torch.Tensor) -> torch.Tensor:  # rows in groups of m*m, the groups in window order
            return t.reshape(n // unit, unit, *t.shape[1:])[order].reshape(t.shape)

        pos = patch_positions(grid_thw, spec.spatial_merge_size).to(x.device)
        rot = rotary_2d(pos, spec.head_dim, spec.rope_theta)
        rot = RotaryTables(permute(rot.cos), permute(rot.sin))
        x = permute(x)
        for i, block in enumerate(self.blocks):
            x = block(x, rot, frames if i in spec.fullatt_block_indexes else windows)
        merged = self.merger(x)
        return merged[torch.argsort(order)], None


class Qwen3VisionTower(nn.Module):
    """Qwen3-VL's vision transformer (HF names: patch_embed.proj, pos_embed, blocks.N.{norm1, attn.{qkv, proj},
    norm2, mlp.linear_fc{1,2}}, merger.{norm, linear_fc1, linear_fc2}, deepstack_merger_list.K.*)."""

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.patch_embed = PatchEmbed(spec, bias=True)
        self.pos_embed = embedding(spec.num_position_embeddings, spec.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(spec) for _ in range(spec.depth))
        self.merger = Qwen3Merger(spec, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3Merger(spec, postshuffle=True)
                                                   for _ in spec.deepstack_visual_indexes)

    def position_embeddings(self, grid_thw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N, hidden] fp32: the learned side x side grid resampled bilinearly (align_corners) to each image's
        h x w patches, at each patch's (row, column); the same for every frame."""
        side = int(self.spec.num_position_embeddings ** 0.5)
        counts = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).to(positions.device)
        sizes = grid_thw[:, 1:].to(positions.device).repeat_interleave(counts, dim=0)  # [N, 2]: h, w

        def taps(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)  # endpoints on the grid's corners
            lo = torch.floor(src)
            frac = src - lo
            lo = lo.long()
            return (torch.stack([lo, lo + 1], -1).clamp(0, side - 1),
                    torch.stack([1 - frac, frac], -1))  # [N, 2] taps, [N, 2] weights

        rt, rw = taps(positions[:, 0], sizes[:, 0])
        ct, cw = taps(positions[:, 1], sizes[:, 1])
        index = (rt[:, :, None] * side + ct[:, None, :]).reshape(-1, 4)
        weight = (rw[:, :, None] * cw[:, None, :]).reshape(-1, 4)
        return (self.pos_embed(index) * weight[:, :, None]).sum(1)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        spec = self.spec
        x = self.patch_embed(pixels)
        pos = patch_positions(grid_thw, spec.spatial_merge_size).to(x.device)
        x = x + self.position_embeddings(grid_thw, pos).to(x.dtype)
        rot = rotary_2d(pos, spec.head_dim, spec.rope_theta)
        frames = frame_bounds(grid_thw)
        deep = []
        for i, block in enumerate(self.blocks):
            x = block(x, rot, frames)
            if i in spec.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[spec.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), (torch.stack(deep) if deep else None)


# ------------------------------------------------------------------------------------------------ the model


class VisionLanguageLM(CausalLM):
    """The text decoder of a vision-language family with its vision tower (`visual`). Tensor parallelism is
    refused (tp 1 only for now). forward takes M-RoPE positions int64 [3, T] (or [T]: the same on every row),
    `input_embeds` [T, H] (the image rows replaced by encode_images' output) and Qwen3-VL's `deepstack`."""

    def __init__(self, cfg: ModelConfig, max_pos: int, tp: TPGroup = SINGLE) -> None:
        if tp.size > 1:
            raise ValueError(f"{cfg.model_type}: vision-language models run with --tp 1 for now (got tp {tp.size})")
        if cfg.vision is None or not cfg.mrope_section:
            raise ValueError(f"{cfg.model_type}: the ModelConfig has no vision_config / mrope_section")
        super().__init__(cfg, max_pos, tp, dense_mlp)
        spec = vision_spec(cfg.vision, cfg.model_type)
        self.visual = Qwen25VisionTower(spec) if spec.kind == "qwen2_5_vl" else Qwen3VisionTower(spec)
        self._rows: torch.Tensor | None = None  # M-RoPE row of each frequency, made on first use (not a buffer)

    def mrope(self, positions: torch.Tensor) -> RotaryTables:
        """The rotary tables of positions int64 [3, T] (M-RoPE) or [T] (plain)."""
        if positions.dim() == 1:
            return self.rotary.tables(positions)
        if self._rows is None or self._rows.device != positions.device:
            self._rows = mrope_rows(self.cfg.head_dim // 2, self.cfg.mrope_section, self.cfg.mrope_interleaved,
                                    positions.device)
        return self.rotary.mrope_tables(positions, self._rows)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                input_embeds: torch.Tensor | None = None,
                deepstack: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids int64 [T], positions int64 [3, T] -> final hidden states [T, H]. deepstack: (rows int64 [m]
        into this forward's T tokens, feats [k, m, H]): after decoder layer i < k, hidden[rows] += feats[i] (in
        the hidden states' dtype), as transformers adds them."""
        x = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        rotary = self.mrope(positions)
        rows, feats = deepstack if deepstack is not None else (None, None)
        for i, layer in enumerate(self.layers):
            x = layer(x, rotary, ctx)
            if feats is not None and i < feats.shape[0]:
                x = x.index_add(0, rows, feats[i].to(x.dtype))
        return self.norm(x)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor,
                      grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """pixel_values [P, C*Tp*p*p] (the processor's, images concatenated), grid_thw int64 [n, 3] -> (image
        token rows [N, H], deepstack features [k, N, H] or None), N = sum(t*h*w) / m^2, rows in image order; in
        the model's dtype."""
        return encode_with(self.visual, pixel_values, grid_thw, self.embed_tokens.weight.dtype)


def encode_with(visual: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`VisionLanguageLM.encode_images` over a tower alone (the encoder role holds no language model)."""
    grid_thw = grid_thw.cpu()
    spec = visual.spec
    if pixel_values.dim() != 2 or pixel_values.shape[1] != spec.patch_dim:
        raise ValueError(f"pixel_values must be [patches, {spec.patch_dim}], got {tuple(pixel_values.shape)}")
    m = spec.spatial_merge_size
    if (grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or bool((grid_thw[:, 1:] % m).any())
            or bool((grid_thw < 1).any())):
        raise ValueError(f"grid_thw must be [n, 3] of t, h, w >= 1 with h, w multiples of {m}")
    if int(grid_thw.prod(-1).sum()) != pixel_values.shape[0]:
        raise ValueError(f"grid_thw covers {int(grid_thw.prod(-1).sum())} patches, pixel_values has "
                         f"{pixel_values.shape[0]}")
    embeds, deep = visual(pixel_values.to(dtype), grid_thw)
    return embeds.to(dtype), (None if deep is None else deep.to(dtype))


class VisionTower(nn.Module):
    """A vision-language checkpoint's tower alone (`pdserve encoder`): `encode_images` as the whole model's."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        spec = vision_spec(cfg.vision, cfg.model_type)
        self.visual = Qwen25VisionTower(spec) if spec.kind == "qwen2_5_vl" else Qwen3VisionTower(spec)

    @property
    def deepstack_layers(self) -> int:
        return self.cfg.deepstack_layers

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor,
                      grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return encode_with(self.visual, pixel_values, grid_thw, next(self.parameters()).dtype)


def tower_weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The tower's weights (VisionTower's names) of a vision-language checkpoint; the language model's are
    left unread. Missing tower weights: ValueError naming them."""
    vis = "model.visual." if any(n.startswith("model.visual.") for n in raw) else "visual."
    with torch.device("meta"):
        tower = VisionTower(cfg)
    out = {}
    for name, _ in tower.visual.named_parameters():
        if vis + name not in raw:
            raise ValueError(f"weight {vis + name} is missing")
        t = raw[vis + name]
        out["visual." + name] = t.reshape(t.shape[0], -1) if name == "patch_embed.proj.weight" else t
    return out


def vl_weights(raw: Mapping[str, torch.Tensor], cfg: ModelConfig, tp: TPGroup) -> dict[str, torch.Tensor]:
    """A vision-language checkpoint -> VisionLanguageLM's names. Text: `model.layers.*` / `model.embed_tokens`
    (the Qwen2.5-VL hub) or `model.language_model.*` (transformers 5, Qwen3-VL); vision: `visual.*` or
    `model.visual.*`; `lm_head`. The patch embedding's Conv3d weight is flattened to the linear's [E, C*Tp*p*p].
    Missing or unexpected names: ValueError naming them."""
    if tp.size > 1:
        raise ValueError(f"{cfg.model_type}: vision-language models run with --tp 1 for now (got tp {tp.size})")
    ck = Checkpoint(raw)
    lm = "model.language_model." if "model.language_model.embed_tokens.weight" in raw else "model."
    vis = "model.visual." if any(n.startswith("model.visual.") for n in raw) else "visual."
    out = shell_weights(ck, cfg, tp, prefix=lm)
    for i in range(cfg.num_layers):
        out |= attention_weights(ck, cfg, i, tp, prefix=lm)
        out |= dense_mlp_weights(ck, f"{lm}layers.{i}.mlp.", f"layers.{i}.mlp.", cfg.intermediate_size, tp)
    spec = vision_spec(cfg.vision, cfg.model_type)
    with torch.device("meta"):
        tower = Qwen25VisionTower(spec) if spec.kind == "qwen2_5_vl" else Qwen3VisionTower(spec)
    for name, _ in tower.named_parameters():
        t = ck.take(vis + name)
        if name == "patch_embed.proj.weight":
            t = t.reshape(t.shape[0], -1)
        out["visual." + name] = t
    ck.done()
    return out
