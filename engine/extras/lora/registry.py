"""The adapters one rank holds: a bounded number of slots, LRU eviction of unused adapters.

`LoRARegistry` lives on the ModelRunner (`runner.lora`, None when the engine runs without LoRA:
`--max-loaded-loras 0` and no `--lora-paths`). Contract:
- `load(name, path, busy)` reads a PEFT directory into a free slot; with every slot taken it evicts
  the least recently used adapter not named in `busy` (the adapters requests still use), and raises
  `LoRAError(409)` when all are busy. A name already loaded from the same path is a no-op (touched);
  from another path, `LoRAError(409)`. A bad adapter is `LoRAError(400)` naming the field.
- `unload(name)`: frees its slot; `LoRAError(404)` if it is not loaded. The caller (the service
  frontend, service/lora.py) refuses to unload an adapter requests still use.
- `batch(names, lens)`: the forward's LoRABatch (None when no segment names an adapter); a name not
  loaded is a KeyError (the frontend admits only loaded names, in order with unloads).
Under TP every rank holds its own registry; load/unload run as rank ops on all of them
(engine/extras/lora/runner.py, through `runner.collective`), each rank slicing A/B like its base layers.
Where the model's Triton kernels run (CUDA, or the triton attention backend: engine.attention.base.
triton_kernels) each (layer, module) also has slot stacks A [S, R, in], B [S, out, R] (R = the module's
widest fused rank, zero-padded) for the Triton SGMV kernel.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path
from typing import Any

import torch

from engine.attention.base import triton_kernels
from engine.config import EngineConfig, ModelConfig
from engine.distributed.tp import SINGLE, TPGroup
from engine.extras.lora.adapter import MODULES, LoRAAdapter, load_adapter, read_config, target_list
from engine.extras.lora.batch import ConcatWeights, LoRABatch


class LoRAError(ValueError):
    """A load/unload refused: `code` is the HTTP status (400 bad adapter, 404 unknown, 409 conflict)."""

    def __init__(self, message: str, code: int = 400) -> None:
        super().__init__(message)
        self.code = code


def parse_lora_paths(items: Collection[str]) -> dict[str, str]:
    """`--lora-paths NAME=PATH ...` -> {name: path}; ValueError naming the flag for a malformed item."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-paths items are NAME=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"--lora-paths names adapter {name!r} twice")
        out[name] = path
    return out


class LoRARegistry:
    def __init__(self, cfg: ModelConfig, slots: int, max_rank: int, tp: TPGroup = SINGLE,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 slot_stacks: bool | None = None) -> None:
        """`slot_stacks`: keep the Triton SGMV path's per-slot stacks (None: on CUDA only)."""
        self.cfg, self.slots, self.max_rank, self.tp = cfg, slots, max_rank, tp
        self.dtype, self.device = dtype, torch.device(device)
        if slot_stacks is None:
            slot_stacks = self.device.type == "cuda"
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slot_of: dict[str, int] = {}
        self.load_seconds: dict[str, float] = {}
        self.stacks: dict | None = {} if slot_stacks else None
        self._concat: dict[tuple[str, ...], ConcatWeights] = {}  # CPU path, by adapter set (cleared on changes)

    def names(self) -> list[str]:
        return list(self.adapters)

    def check(self, name: str, path: str) -> None:
        """The cheap checks of `load` (config, rank, targets) without reading tensors; LoRAError(400)."""
        if not name:
            raise LoRAError("lora_name must not be empty")
        if not Path(path).is_dir():
            raise LoRAError(f"lora_path {path!r} is not a directory")
        try:
            raw = read_config(Path(path))
            target_list(raw)
        except ValueError as e:
            raise LoRAError(f"adapter {name!r}: {e}") from e
        if int(raw.get("r", 8)) > self.max_rank:
            raise LoRAError(f"adapter {name!r}: rank r={raw.get('r')} exceeds --max-lora-rank {self.max_rank}")

    def load(self, name: str, path: str, busy: Collection[str] = ()) -> str | None:
        """Load `name` from `path` (see the module contract); returns the adapter evicted, if any."""
        if name in self.adapters:
            if self.adapters[name].path != str(path):
                raise LoRAError(f"adapter {name!r} is already loaded from {self.adapters[name].path}", 409)
            self.adapters.move_to_end(name)
            return None
        self.check(name, path)
        evicted = None
        if len(self.adapters) >= self.slots:
            evicted = next((n for n in self.adapters if n not in busy), None)
            if evicted is None:
                raise LoRAError(f"all {self.slots} LoRA slots (--max-loaded-loras) hold adapters in use; "
                                f"cannot load {name!r}", 409)
        t0 = time.perf_counter()
        try:
            adapter = load_adapter(name, path, self.cfg, self.max_rank, self.tp, self.dtype, self.device)
        except ValueError as e:
            raise LoRAError(str(e)) from e
        if evicted is not None:
            self.unload(evicted)
        slot = min(set(range(self.slots)) - set(self.slot_of.values()))
        self.adapters[name], self.slot_of[name] = adapter, slot
        if self.stacks is not None:
            self._stack(adapter, slot)
        self.load_seconds[name] = time.perf_counter() - t0
        return evicted

    def unload(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded", 404)
        del self.adapters[name]
        self._concat.clear()
        slot = self.slot_of.pop(name)
        if self.stacks is not None:
            for a, b in self.stacks.values():
                a[slot].zero_()
                b[slot].zero_()

    def batch(self, names: list[str], lens: list[int]) -> LoRABatch | None:
        """The LoRABatch of one forward's segments (names "" = base); marks the adapters used."""
        if not any(names):
            return None
        for n in set(names) - {""}:
            if n in self.adapters:
                self.adapters.move_to_end(n)
        return LoRABatch.build(names, lens, self.adapters, self.device, self.concat,
                               self.slot_of if self.stacks is not None else None, self.stacks)

    def concat(self, names: tuple[str, ...]) -> ConcatWeights:
        """The adapters `names` side by side, per layer and module (cached for the last few sets)."""
        cw = self._concat.get(names)
        if cw is None:
            if len(self._concat) >= 8:
                self._concat.pop(next(iter(self._concat)))
            cw = self._concat[names] = _concat([self.adapters[n] for n in names])
        return cw

    def _stack(self, adapter: LoRAAdapter, slot: int) -> None:
        """Write the adapter into slot `slot` of the Triton path's stacks (allocated on first use, max rank wide)."""
        for layer, mods in enumerate(adapter.weights):
            for mod, (a, b) in mods.items():
                key = (layer, mod)
                if key not in self.stacks:
                    width, kw = self.max_rank * len(MODULES[mod]), {"dtype": self.dtype, "device": self.device}
                    self.stacks[key] = (torch.zeros(self.slots, width, a.shape[1], **kw),
                                        torch.zeros(self.slots, b.shape[0], width, **kw))
                sa, sb = self.stacks[key]
                sa[slot].zero_()
                sb[slot].zero_()
                sa[slot, : a.shape[0]] = a
                sb[slot, :, : b.shape[1]] = b


def _concat(adapters: list[LoRAAdapter]) -> ConcatWeights:
    """A_cat [sum R, in] and B_cat [out, sum R] per layer and module; an adapter that does not target a
    module has width 0 there (PEFT targets the same modules in every layer)."""
    cat: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    widths: dict[str, list[int]] = {}
    for layer in range(len(adapters[0].weights)):
        mods = {}
        for mod in MODULES:
            pairs = [ad.weights[layer].get(mod) for ad in adapters]
            present = [p for p in pairs if p is not None]
            if present:
                mods[mod] = (torch.cat([a for a, _ in present]), torch.cat([b for _, b in present], dim=1))
                widths[mod] = [0 if p is None else p[0].shape[0] for p in pairs]
        cat.append(mods)
    return ConcatWeights(cat, widths)


def registry_for(cfg: EngineConfig, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 device: torch.device) -> LoRARegistry | None:
    """A runner's registry (`runner.lora`) with `--lora-paths` loaded (ValueError naming the flag for a
    bad one), or None when LoRA is off (`--max-loaded-loras` 0 and no `--lora-paths`)."""
    paths = parse_lora_paths(cfg.lora_paths)
    if not cfg.max_loaded_loras and not paths:
        return None
    slots = max(cfg.max_loaded_loras, len(paths))
    reg = LoRARegistry(mc, slots, cfg.max_lora_rank, tp, dtype, device,
                       slot_stacks=triton_kernels(cfg.resolved_attention_backend, device))
    for name, path in paths.items():
        try:
            reg.load(name, path)
        except LoRAError as e:
            raise ValueError(f"--lora-paths {name}={path}: {e}") from e
    return reg


def info(reg: LoRARegistry | None) -> dict[str, Any]:
    """The server-info fields of LoRA: `lora_slots` (0: off) and `lora_adapters` {name: path}."""
    if reg is None:
        return {"lora_slots": 0, "lora_adapters": {}}
    return {"lora_slots": reg.slots, "lora_adapters": {n: a.path for n, a in reg.adapters.items()}}
