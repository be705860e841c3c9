"""The ModelRunner's LoRA hooks: the registry it builds, the batch cap, and the TP rank ops.

- `registry_for(runner)`: the runner's LoRARegistry (None when LoRA is off: `max_loaded_loras` 0 and
  no `lora_paths`), with `lora_paths` loaded at start-up (ValueError naming the flag for a bad one).
- `split_by_adapters(segments, cap)`: a forward whose segments name more than `cap` distinct adapters
  (`--max-loras-per-batch`) runs as several forwards of at most `cap` each (segments are independent:
  each writes only its own KV positions); results keep the segments' order.
- `load(runner, name, path, busy)` / `unload(runner, name)`: on every rank of a TP group (rank ops
  "lora_load" / "lora_unload"); the cheap checks run on rank 0 first so a bad adapter never reaches a
  rank's loop.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from engine.distributed import tp_ranks
from engine.extras.lora.registry import LoRAError, LoRARegistry, parse_lora_paths

if TYPE_CHECKING:
    from engine.forward.model_runner import ModelRunner, Segment


def registry_for(runner: ModelRunner) -> LoRARegistry | None:
    """The runner's registry with the start-up adapters loaded, or None when LoRA is off."""
    cfg = runner.cfg
    paths = parse_lora_paths(cfg.lora_paths)
    if not cfg.max_loaded_loras and not paths:
        return None
    mc = runner.model_cfg
    if getattr(mc, "mla", None) is not None:
        raise ValueError("--lora-paths / --max-loaded-loras: LoRA is not supported for MLA models")
    slots = max(cfg.max_loaded_loras, len(paths))
    reg = LoRARegistry(mc, slots, cfg.max_lora_rank, runner.tp, runner.dtype, runner.device)
    for name, path in paths.items():
        try:
            reg.load(name, path)
        except LoRAError as e:
            raise ValueError(f"--lora-paths {name}={path}: {e}") from e
    return reg


def split_by_adapters(segments: list[Segment], cap: int) -> list[list[int]]:
    """Indices of `segments` in groups naming at most `cap` distinct adapters each (one group when they fit)."""
    if len({s.lora for s in segments} - {""}) <= cap:
        return [list(range(len(segments)))]
    groups: list[list[int]] = [[]]
    names: set[str] = set()
    for i, s in enumerate(segments):
        if s.lora and s.lora not in names and len(names) >= cap:
            groups.append([])
            names = set()
        if s.lora:
            names.add(s.lora)
        groups[-1].append(i)
    return groups


def forward_split(runner: ModelRunner, segments: list[Segment]) -> list[Any] | None:
    """The forward's results run as several forwards when its adapters exceed --max-loras-per-batch;
    None when one forward takes them all (the caller runs it)."""
    groups = split_by_adapters(segments, runner.cfg.max_loras_per_batch)
    if len(groups) == 1:
        return None
    out: list[Any] = [None] * len(segments)
    for g in groups:
        for i, res in zip(g, runner.run_forward([segments[i] for i in g])):
            out[i] = res
    return out


def _check_model(reg: LoRARegistry, name: str, path: str) -> None:
    """An adapter that targets the MLP of a mixture-of-experts model is refused (400)."""
    from pathlib import Path

    from engine.extras.lora.adapter import MLP, read_config, target_list

    if reg.cfg.moe is not None and set(target_list(read_config(Path(path)))) & set(MLP):
        raise LoRAError(f"adapter {name!r} targets MLP modules; this mixture-of-experts model takes LoRA "
                        "on attention (q/k/v/o_proj) only")


def load(runner: ModelRunner, name: str, path: str, busy: Collection[str] = ()) -> str | None:
    """Load `name` on every rank; returns the adapter evicted to make room (None if none). LoRAError."""
    reg = runner.lora
    if reg is None:
        raise LoRAError("LoRA is off on this server (start it with --max-loaded-loras N or --lora-paths)", 400)
    reg.check(name, path)
    _check_model(reg, name, path)
    return runner.collective("lora_load", lora_name=name, path=path, busy=list(busy))


def unload(runner: ModelRunner, name: str) -> None:
    """Unload `name` on every rank; LoRAError(404) when it is not loaded."""
    if runner.lora is None or name not in runner.lora.adapters:
        raise LoRAError(f"LoRA adapter {name!r} is not loaded", 404)
    runner.collective("lora_unload", lora_name=name)


@tp_ranks.rank_op("lora_load")
def _load(runner: Any, lora_name: str, path: str, busy: list[str]) -> str | None:
    return runner.lora.load(lora_name, path, busy)


@tp_ranks.rank_op("lora_unload")
def _unload(runner: Any, lora_name: str) -> None:
    runner.lora.unload(lora_name)


def info(runner: ModelRunner) -> dict[str, Any]:
    """The server-info fields of LoRA: `lora_slots` (0: off) and `lora_adapters` {name: path}."""
    reg = runner.lora
    if reg is None:
        return {"lora_slots": 0, "lora_adapters": {}}
    return {"lora_slots": reg.slots, "lora_adapters": {n: a.path for n, a in reg.adapters.items()}}
