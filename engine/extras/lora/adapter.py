"""One PEFT LoRA adapter read into the shared layers' fused layout, sliced for one TP rank.

A PEFT directory holds `adapter_config.json` (r, lora_alpha, target_modules, use_rslora) and
`adapter_model.safetensors` (or `.bin`) with, per targeted linear,
`base_model.model.model.layers.N.<self_attn|mlp>.<name>.lora_A.weight` [r, in] and `...lora_B.weight`
[out, r]; the update is x A^T B^T * scaling, scaling = alpha / r (alpha / sqrt(r) with rslora).

Our linears are fused (layers.py): qkv_proj = [q; k; v] rows, gate_up_proj = [gate; up] rows. A fused
module's update is one pair: A = the targeted parts' A stacked [R, in] (R = the sum of their ranks),
B = [out, R] block-diagonal (a part's rows use only its own rank columns, untargeted parts' rows are
0), scaling folded into B. Modules: "qkv", "o", "gate_up", "down".

TP slicing follows the base layers (engine/models/checkpoint.py): column-parallel qkv and gate_up keep
B's rows of this rank's heads / intermediate share (A whole); row-parallel o and down keep A's columns
of this rank's input share (B whole), so each rank's partial update is summed by the layer's all-reduce.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.config import ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.models.checkpoint import cols, rows
from engine.models.deepseek import rope_row_order  # the MLA family's row order, written once there

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLA_ATTN = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")  # MLA's projections (beside q_proj / o_proj)
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTN + MLA_ATTN + MLP
# fused module -> the HF linears it holds; every family's (an adapter's weights name the ones its model has)
MODULES = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
           "down": ("down_proj",), "q": ("q_proj",), "q_a": ("q_a_proj",), "q_b": ("q_b_proj",),
           "kv_a": ("kv_a_proj_with_mqa",)}
# MLA: kv_b_proj is absorbed into the attention (W_UK into the query, W_UV into the output, per head), so an
# update of it would need each adapter's own absorbed matrices: refused by name
MLA_MODULES = ("q", "q_a", "q_b", "kv_a", "o", "gate_up", "down")
DENSE_MODULES = ("qkv", "o", "gate_up", "down")
# where a family's decoder modules sit in its HF model, when not at model.layers.<i>.{self_attn,mlp}
# (PEFT's keys name that path: base_model.model.<path>.<module>.lora_A.weight); several: any of them
# (Nemotron-H: transformers' own class names it model.layers.<i>.mixer, NVIDIA's remote code backbone....)
PATHS = {"nemotron_h": ("model.layers.{layer}.mixer", "backbone.layers.{layer}.mixer")}
# adapter_config.json fields that change the math and that this engine refuses when set
_REFUSED = ("use_dora", "modules_to_save", "layers_to_transform", "rank_pattern", "alpha_pattern", "bias")


@dataclass
class LoRAAdapter:
    """An adapter's weights: `weights[layer][module] = (A [R, in_local], B [out_local, R])` (scaled)."""

    name: str
    path: str
    rank: int
    targets: tuple[str, ...]
    weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)

    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for layer in self.weights for a, b in layer.values())


def read_config(path: Path) -> dict:
    """adapter_config.json as a dict; ValueError naming the field or file for what cannot be served."""
    f = path / "adapter_config.json"
    if not f.is_file():
        raise ValueError(f"lora_path {str(path)!r} has no adapter_config.json")
    raw = json.loads(f.read_text())
    if raw.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"adapter_config.json field 'peft_type' ({raw.get('peft_type')!r}) is not LORA")
    for key in _REFUSED:
        if raw.get(key) not in (None, False, [], {}, "none"):
            raise ValueError(f"adapter_config.json field {key!r} ({raw[key]!r}) is not supported by this engine")
    return raw


def target_list(raw: dict, cfg: ModelConfig | None = None) -> tuple[str, ...]:
    """The base linears the adapter targets (a list, or PEFT's "all-linear": every one a model of `cfg`
    has, when given)."""
    tm = raw.get("target_modules")
    if tm == "all-linear":
        return TARGETS if cfg is None else tuple(t for m in _modules(cfg) for t in MODULES[m] if _has(cfg, t))
    if isinstance(tm, str) or not tm:
        raise ValueError(f"adapter_config.json field 'target_modules' ({tm!r}) must list module names")
    if "kv_b_proj" in tm:
        raise ValueError("adapter_config.json field 'target_modules' names 'kv_b_proj': MLA absorbs it into the "
                         "attention (per head, into the query and the output), so LoRA on it is not supported; "
                         f"target {list(('q_proj',) + MLA_ATTN + ('o_proj',))} instead")
    bad = sorted(set(tm) - set(TARGETS))
    if bad:
        raise ValueError(f"adapter_config.json field 'target_modules' names {bad}: only {list(TARGETS)} are supported")
    return tuple(t for t in TARGETS if t in tm)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        return load_file(str(st))
    bn = path / "adapter_model.bin"
    if bn.is_file():
        return torch.load(str(bn), map_location="cpu", weights_only=True)
    raise ValueError(f"lora_path {str(path)!r} has no adapter_model.safetensors")


def _modules(cfg: ModelConfig) -> tuple[str, ...]:
    return MLA_MODULES if cfg.mla is not None else DENSE_MODULES


def _has(cfg: ModelConfig, part: str) -> bool:
    """Whether a model of `cfg` has HF linear `part` (MLA: q_proj or q_a/q_b by q_lora_rank; no k/v)."""
    m = cfg.mla
    if m is None:
        return part not in MLA_ATTN
    if part in ("k_proj", "v_proj"):
        return False
    if part == "q_proj":
        return not m.q_lora_rank
    if part in ("q_a_proj", "q_b_proj"):
        return bool(m.q_lora_rank)
    return True  # o_proj, kv_a_proj_with_mqa, the MLP


def _attention(cfg: ModelConfig) -> list[str]:
    """The attention linears a model of `cfg` has (what an adapter for an MoE or hybrid model may target)."""
    return [t for t in ATTN + MLA_ATTN if _has(cfg, t)]


def _shares(cfg: ModelConfig, tp: TPGroup) -> dict[str, tuple[int, int, int]]:
    """Per HF linear: (first, count, unit) of this rank's output rows (column-parallel) or input
    columns (row-parallel), as checkpoint.attention_weights / dense_mlp_weights slice them."""
    if cfg.mla is not None:  # q / q_b and o by head; q_a and kv_a replicated on every rank (all rows)
        m = cfg.mla
        q0, nq = tp.split(cfg.num_heads, "num_attention_heads")
        i0, ni = tp.split(cfg.intermediate_size, "intermediate_size")
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        return {"q_proj": (q0, nq, qk), "q_b_proj": (q0, nq, qk), "q_a_proj": (0, m.q_lora_rank, 1),
                "kv_a_proj_with_mqa": (0, m.latent_dim, 1), "o_proj": (q0, nq, m.v_head_dim),
                "gate_proj": (i0, ni, 1), "up_proj": (i0, ni, 1), "down_proj": (i0, ni, 1)}
    d = cfg.head_dim
    qd = 2 * d if getattr(cfg.hybrid, "q_gate", False) else d  # Qwen3-Next's q_proj: [q | gate] per head
    q0, nq = tp.split(cfg.num_heads, "num_attention_heads")
    k0, nk = tp.kv_heads(cfg.num_kv_heads)
    i0, ni = tp.split(cfg.intermediate_size, "intermediate_size")
    return {"q_proj": (q0, nq, qd), "k_proj": (k0, nk, d), "v_proj": (k0, nk, d), "o_proj": (q0, nq, d),
            "gate_proj": (i0, ni, 1), "up_proj": (i0, ni, 1), "down_proj": (i0, ni, 1)}


def load_adapter(name: str, path: str | Path, cfg: ModelConfig, max_rank: int, tp: TPGroup = SINGLE,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoRAAdapter:
    """Read the PEFT adapter at `path` for a model of `cfg`; ValueError naming the field or weight when
    it cannot be served (rank above `max_rank`, an unsupported target or option, a missing tensor)."""
    p = Path(path)
    raw = read_config(p)
    r, alpha = int(raw.get("r", 8)), float(raw.get("lora_alpha", 8))
    if not 0 < r <= max_rank:
        raise ValueError(f"adapter {name!r}: rank r={r} exceeds --max-lora-rank {max_rank}")
    scaling = alpha / math.sqrt(r) if raw.get("use_rslora") else alpha / r
    targets = target_list(raw, cfg)
    missing = [t for t in targets if not _has(cfg, t)]
    if missing:
        raise ValueError(f"adapter {name!r}: target_modules {missing} are not linears of this model (model_type "
                         f"{cfg.model_type!r})")
    mlp = [t for t in targets if t in MLP]
    if cfg.moe is not None and mlp:
        raise ValueError(f"adapter {name!r}: target_modules {mlp} are the MLP of a mixture-of-experts model "
                         f"(model_type {cfg.model_type!r}, {cfg.moe.num_experts} experts): LoRA on the experts is not "
                         f"supported; an adapter for this model may target only {_attention(cfg)}")
    if cfg.hybrid is not None and mlp:
        raise ValueError(f"adapter {name!r}: target_modules {mlp} are the MLP of a hybrid recurrent model "
                         f"(model_type {cfg.model_type!r}): LoRA there is not supported; an adapter for this model may "
                         f"target only {_attention(cfg)} (its attention layers)")
    tensors = _tensors(p)
    shares = _shares(cfg, tp)
    orders = {}  # MLA: B's rows in the order the loader gave the base weight's (rope rows de-interleaved)
    if cfg.mla is not None:
        orders = {part: rope_row_order(cfg, part, shares[part][1]) for part in ("q_proj", "q_b_proj",
                                                                                "kv_a_proj_with_mqa")}
    out = LoRAAdapter(name, str(path), r, targets)
    for layer in range(cfg.num_layers):
        mods: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        if cfg.attention_layers and layer not in cfg.attention_layers:  # a hybrid model's recurrent layer
            out.weights.append(mods)
            continue
        for mod in _modules(cfg):
            pair = _fused(tensors, _path(cfg, layer), MODULES[mod], targets, shares, scaling, name, orders)
            if pair is not None:
                mods[mod] = (pair[0].to(device, dtype).contiguous(), pair[1].to(device, dtype).contiguous())
        out.weights.append(mods)
    return out


def _path(cfg: ModelConfig, layer: int) -> tuple[str, ...]:
    """The HF module paths `layer`'s modules may sit at (`{sub}`: self_attn or mlp by module), first the usual."""
    paths = PATHS.get(cfg.model_type)
    return tuple(p.format(layer=layer) for p in paths) if paths else (f"model.layers.{layer}.{{sub}}",)


def _fused(tensors: dict[str, torch.Tensor], paths: tuple[str, ...], parts: tuple[str, ...], targets: tuple[str, ...],
           shares: dict[str, tuple[int, int, int]], scaling: float, name: str,
           orders: dict[str, torch.Tensor | None] | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One fused module's (A [R, in_local], B [out_local, R]) over `parts` of the layer at one of the HF
    `paths` (`_path`), or None when none is targeted."""
    if not any(t in targets for t in parts):
        return None
    a_list, b_blocks = [], []
    for part in parts:
        first, count, unit = shares[part]
        if part not in targets:
            b_blocks.append((count * unit, None))
            continue
        sub = "mlp" if part in MLP else "self_attn"
        keys = [f"base_model.model.{p.format(sub=sub)}.{part}.lora_" for p in paths]
        key = next((k for k in keys if k + "A.weight" in tensors), keys[0])
        if key + "A.weight" not in tensors:
            raise ValueError(f"adapter {name!r}: weight {key}A.weight is missing")
        a, b = tensors[key + "A.weight"].float(), tensors[key + "B.weight"].float() * scaling
        if part in ("o_proj", "down_proj"):  # row-parallel: this rank's input columns of A
            a = cols(a, first, count, unit)
        else:  # column-parallel: this rank's output rows of B (in the base weight's row order)
            b = rows(b, first, count, unit)
            order = (orders or {}).get(part)
            if order is not None:
                b = b[order]
        a_list.append(a)
        b_blocks.append((b.shape[0], b))
    a_cat = torch.cat(a_list)  # [R, in]
    big_r = a_cat.shape[0]
    b_cat = torch.zeros(sum(n for n, _ in b_blocks), big_r)
    row, col = 0, 0
    for n, b in b_blocks:
        if b is not None:
            b_cat[row : row + n, col : col + b.shape[1]] = b
            col += b.shape[1]
        row += n
    return a_cat, b_cat


def write_random_adapter(dst: Path, cfg: ModelConfig, rank: int, targets: tuple[str, ...] = TARGETS,
                         seed: int = 0, std: float = 0.01) -> Path:
    """A random PEFT-format LoRA adapter for a model of `cfg` (benchmarks and tests; A and B ~ N(0, std))."""
    g = torch.Generator().manual_seed(seed)
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qd = 2 * d if getattr(cfg.hybrid, "q_gate", False) else d
    shapes = {"q_proj": (cfg.num_heads * qd, h), "k_proj": (cfg.num_kv_heads * d, h),
              "v_proj": (cfg.num_kv_heads * d, h), "o_proj": (h, cfg.num_heads * d), "gate_proj": (inter, h),
              "up_proj": (inter, h), "down_proj": (h, inter)}
    if cfg.mla is not None:
        m, hq = cfg.mla, cfg.num_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        shapes |= {"q_proj": (hq * qk, h), "q_a_proj": (m.q_lora_rank, h), "q_b_proj": (hq * qk, m.q_lora_rank),
                   "kv_a_proj_with_mqa": (m.latent_dim, h), "o_proj": (h, hq * m.v_head_dim)}
    targets = tuple(t for t in targets if _has(cfg, t))
    t = {}
    for layer in range(cfg.num_layers):
        if cfg.attention_layers and layer not in cfg.attention_layers:
            continue
        for name in targets:
            out, inp = shapes[name]
            sub = _path(cfg, layer)[0].format(sub="mlp" if name in MLP else "self_attn")
            key = f"base_model.model.{sub}.{name}.lora_"
            t[key + "A.weight"] = torch.randn(rank, inp, generator=g) * std
            t[key + "B.weight"] = torch.randn(out, rank, generator=g) * std
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                         "target_modules": list(targets)}))
    save_file(t, str(dst / "adapter_model.safetensors"))
    return dst
