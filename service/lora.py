"""LoRA on the service side: flags, the frontend's adapter table, request resolution, the load/unload
endpoints and the worker's handler (engine/extras/lora holds the adapters; docs/architecture.md, "LoRA").

A request picks an adapter by name: `lora_path` on /generate (SGLang's field: a loaded adapter's
name), `model` on /v1 (vLLM's rule: an adapter's name, or the served model's for the base). An unknown
name is refused before the worker sees it: 404 in OpenAI's model_not_found shape on /v1, 400 naming
`lora_path` on /generate, 412 on a decode (the PD room needs an adapter this decode lacks: load it
here, or let the router pick a decode that has it; the router prefers those).

The frontend is the one authority on adapter use: `AdapterTable` counts each adapter's requests in
flight (acquired when sent to the worker, released when the request ends), so `POST
/unload_lora_adapter` is refused with 409 while one runs, and `POST /load_lora_adapter` tells the
worker which adapters are busy (a full slot table evicts the least recently used other one). Load and
unload travel on the same ordered channel as requests, so the worker never sees a request for an
adapter it has unloaded.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from engine.extras.lora import runner as lora_runner
from engine.extras.lora.registry import LoRAError
from service import messages as m
from service.protocol import RequestError

log = logging.getLogger("pdserve.lora")


class ModelNotFound(RequestError):
    """/v1's unknown `model`: 404 with OpenAI's body (code model_not_found, param model)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"The model '{name}' does not exist (no such base model or LoRA adapter)", 404)
        self.name = name

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": "invalid_request_error", "param": "model",
                          "code": "model_not_found"}}


class AdapterTable:
    """The frontend's adapters: name -> path, and requests in flight per adapter. Filled from the
    worker's ready info (`lora_adapters`, `lora_slots`) on first use."""

    def __init__(self) -> None:
        self.paths: dict[str, str] = {}
        self.inflight: Counter[str] = Counter()
        self.last_used: dict[str, int] = {}  # name -> use tick (loads and requests)
        self.tick = 0
        self.slots = 0
        self.synced = False

    def sync(self, info: dict[str, Any]) -> None:
        if not self.synced and info:
            self.paths = dict(info.get("lora_adapters") or {})
            self.slots = int(info.get("lora_slots") or 0)
            self.synced = True

    def resolve(self, kind: str, body: dict[str, Any], base: str, role: str) -> str:
        """The adapter a request names ("" = the base model); RequestError naming the field otherwise."""
        if kind == "generate":
            name = body.get("lora_path")
            if name is None or name == "":
                return ""
            if not isinstance(name, str):
                raise RequestError("'lora_path' must be a loaded LoRA adapter's name (a string)")
            if name not in self.paths:
                raise self._unknown(name, role, f"'lora_path': LoRA adapter {name!r} is not loaded "
                                                f"(loaded: {sorted(self.paths)})")
            return name
        name = body.get("model")
        if not self.slots or not isinstance(name, str) or name in ("", base):
            return ""  # LoRA off: `model` is not checked, as before
        if name not in self.paths:
            raise self._unknown(name, role, "")
        return name

    def _unknown(self, name: str, role: str, message: str) -> RequestError:
        if role == "decode":
            return RequestError(f"LoRA adapter {name!r} is not loaded on this decode; the room needs it "
                                "(load it here with POST /load_lora_adapter)", 412)
        return RequestError(message, 400) if message else ModelNotFound(name)

    def acquire(self, name: str) -> None:
        if name:
            self.inflight[name] += 1
            self.touch(name)

    def touch(self, name: str) -> None:
        self.tick += 1
        self.last_used[name] = self.tick

    def victim(self, name: str) -> str:
        """The adapter loading `name` evicts: the least recently used one no request uses ("" when a
        slot is free, or when every adapter is in use: the worker then refuses with 409)."""
        if name in self.paths or len(self.paths) < self.slots:
            return ""
        idle = [n for n in self.paths if not self.inflight.get(n)]
        return min(idle, key=lambda n: self.last_used.get(n, 0), default="")

    def forget(self, name: str) -> str:
        """Take `name` out of the table before the worker drops it, so that no request parsed meanwhile
        names it; returns its path ("" if absent) to restore on failure."""
        self.last_used.pop(name, None)
        return self.paths.pop(name, "")

    def release(self, name: str) -> None:
        if name:
            self.inflight[name] -= 1
            if self.inflight[name] <= 0:
                del self.inflight[name]

    def cards(self, created: int, base: str) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters."""
        return [{"id": n, "object": "model", "created": created, "owned_by": "pdserve", "root": p, "parent": base}
                for n, p in sorted(self.paths.items())]


def handle_worker(runner: Any, msg: m.LoraReq) -> m.LoraOut:
    """The worker's side of a load/unload (engine/extras/lora/runner.py does it on every TP rank)."""
    t0 = time.perf_counter()
    try:
        if msg.op == "load":
            evicted = lora_runner.load(runner, msg.name, msg.path, msg.busy) or ""
            log.info("LoRA adapter %r loaded from %s in %.3fs%s", msg.name, msg.path, time.perf_counter() - t0,
                     f" (evicted {evicted!r})" if evicted else "")
            return m.LoraOut(token=msg.token, ok=True, code=200, message=f"adapter {msg.name!r} loaded",
                             evicted=evicted, seconds=time.perf_counter() - t0)
        lora_runner.unload(runner, msg.name)
        log.info("LoRA adapter %r unloaded", msg.name)
        return m.LoraOut(token=msg.token, ok=True, code=200, message=f"adapter {msg.name!r} unloaded")
    except LoRAError as e:
        return m.LoraOut(token=msg.token, ok=False, code=e.code, message=str(e))
    except (OSError, RuntimeError) as e:  # an unreadable or corrupt adapter file
        return m.LoraOut(token=msg.token, ok=False, code=400, message=f"adapter {msg.name!r}: {e}")

