"""Loading and unloading adapters on every rank (the runner's registry: engine/extras/lora/registry.py).

- `load(runner, name, path, busy)` / `unload(runner, name)`: on every rank of a TP group (`_load` /
  `_unload` through `runner.collective`, which a TPRunner sends to every rank); the cheap checks run on
  rank 0 first so a bad adapter never reaches a rank's loop.

What LoRA adds to a forward (`Adapter`, the LoRABatch) is engine/extras/lora/batch.py; the registry a
runner builds at start-up, `registry_for`, is engine/extras/lora/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any, Protocol

from engine.extras.lora.adapter import MLP, read_config, target_list
from engine.extras.lora.registry import LoRAError, LoRARegistry


class Runner(Protocol):
    """What load/unload use of a runner (a ModelRunner, or rank 0's TPRunner: engine/distributed)."""

    lora: LoRARegistry | None

    def collective(self, op: Callable[..., Any], **kwargs: Any) -> Any: ...


def _check_model(reg: LoRARegistry, name: str, path: str) -> None:
    """An adapter that targets the MLP of a mixture-of-experts model is refused (400)."""
    if reg.cfg.moe is not None and set(target_list(read_config(Path(path)))) & set(MLP):
        raise LoRAError(f"adapter {name!r} targets MLP modules; this mixture-of-experts model takes LoRA "
                        "on attention (q/k/v/o_proj) only")


def load(runner: Runner, name: str, path: str, busy: Collection[str] = ()) -> str | None:
    """Load `name` on every rank; returns the adapter evicted to make room (None if none). LoRAError."""
    reg = runner.lora
    if reg is None:
        raise LoRAError("LoRA is off on this server (start it with --max-loaded-loras N or --lora-paths)", 400)
    reg.check(name, path)
    _check_model(reg, name, path)
    return runner.collective(_load, lora_name=name, path=path, busy=list(busy))


def unload(runner: Runner, name: str) -> None:
    """Unload `name` on every rank; LoRAError(404) when it is not loaded."""
    if runner.lora is None or name not in runner.lora.adapters:
        raise LoRAError(f"LoRA adapter {name!r} is not loaded", 404)
    runner.collective(_unload, lora_name=name)


def _load(runner: Any, lora_name: str, path: str, busy: list[str]) -> str | None:
    return runner.lora.load(lora_name, path, busy)


def _unload(runner: Any, lora_name: str) -> None:
    runner.lora.unload(lora_name)
