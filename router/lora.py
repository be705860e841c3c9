"""Adapter-aware routing (issue 41): prefer workers that hold the LoRA adapter a request names.

Each service's /health body lists its adapters (`lora_adapters`, service/lora.py); the health checker
keeps them on the Worker. A request names an adapter by `lora_path` (/generate) or `model` (/v1); the
pick then chooses among the eligible workers holding it, and among all of them when none does (the
service answers for an adapter it lacks: 404/400 on a prefill or colocated, 412 on a decode).
"""

from __future__ import annotations

from typing import Any

from router.protocol import ProxyRequest
from router.registry import Worker


def adapters_of(resp: Any) -> frozenset[str]:
    """The adapter names in a /health response's JSON body (none when it has no such list)."""
    try:
        names = resp.json().get("lora_adapters")
    except (ValueError, AttributeError):
        return frozenset()
    return frozenset(n for n in names if isinstance(n, str)) if isinstance(names, list) else frozenset()


def adapter_of(req: ProxyRequest) -> str:
    """The adapter name a request may name ("" none): `lora_path` on /generate, `model` on /v1."""
    name = req.body.get("lora_path" if req.endpoint == "/generate" else "model")
    return name if isinstance(name, str) else ""


def prefer(candidates: list[Worker], adapter: str) -> list[Worker]:
    """The candidates holding `adapter` when any does, else all of them."""
    if not adapter:
        return candidates
    holding = [w for w in candidates if adapter in w.loras]
    return holding or candidates


def merge_models(bodies: list[dict]) -> dict:
    """One /v1/models list from several workers' (the base model once, every adapter once)."""
    seen: dict[str, dict] = {}
    for b in bodies:
        for card in b.get("data") or []:
            if isinstance(card, dict) and isinstance(card.get("id"), str):
                seen.setdefault(card["id"], card)
    return {"object": "list", "data": list(seen.values())}
