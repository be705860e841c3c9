"""The LoRA flags of every service and of `pdserve up` (service/lora.py, engine/extras/lora)."""

from __future__ import annotations

import argparse
from typing import Any

from engine.config import EngineConfig


def add_lora_args(p: argparse.ArgumentParser) -> None:
    """The LoRA flags of every service (and `pdserve up`)."""
    d = EngineConfig()
    g = p.add_argument_group("LoRA adapters", "serve PEFT LoRA adapters over the base model; a request names "
                             "one by `model` (/v1) or `lora_path` (/generate)")
    g.add_argument("--lora-paths", nargs="+", default=[], metavar="NAME=PATH",
                   help="adapters loaded at start-up: PEFT directories (adapter_config.json + "
                        "adapter_model.safetensors) under the names requests use")
    g.add_argument("--max-loaded-loras", type=int, default=d.max_loaded_loras,
                   help="adapter slots (default: as many as --lora-paths; 0 and no --lora-paths: LoRA off). "
                        "Loading into a full table evicts the least recently used adapter no request uses")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest adapter rank r accepted")
    g.add_argument("--max-loras-per-batch", type=int, default=d.max_loras_per_batch,
                   help="distinct adapters in one forward; a batch naming more runs as several forwards")


def lora_flags(a: Any) -> list[str]:
    """The LoRA flags `pdserve up` passes to every worker (its config `a` has the flags' fields)."""
    d = EngineConfig()
    out = ["--lora-paths", *a.lora_paths] if a.lora_paths else []
    for flag, field in (("--max-loaded-loras", "max_loaded_loras"), ("--max-lora-rank", "max_lora_rank"),
                        ("--max-loras-per-batch", "max_loras_per_batch")):
        if getattr(a, field) != getattr(d, field):
            out += [flag, str(getattr(a, field))]
    return out
