"""The LoRA load/unload endpoints of every service (service/lora.py has the rules they follow)."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from common import api_schema
from common.api_requests import NonEmpty, _Open
from common.http import error_body
from service import messages as m
from service.lora import AdapterTable
from service.protocol import RequestError, parse_json_body


class LoadLoraRequest(_Open):
    lora_name: NonEmpty = Field(description="the name requests give (lora_path, or model on /v1)")
    lora_path: NonEmpty = Field(description="the adapter's directory (PEFT: adapter_config.json + weights)")


class UnloadLoraRequest(_Open):
    lora_name: NonEmpty


def lora_routes(app: Any, state: Any) -> None:
    """POST /load_lora_adapter {lora_name, lora_path} and /unload_lora_adapter {lora_name} (also under
    /v1/, vLLM's paths): 200 {success, message}, 400 bad body or adapter, 404 not loaded, 409 in use
    or no free slot, 503 worker not running."""
    def fail(message: str, status: int) -> JSONResponse:
        return JSONResponse(error_body(message, status), status_code=status)

    async def body_fields(request: Request, need: tuple[str, ...]) -> dict[str, str]:
        body = parse_json_body(await request.body())
        for f in need:
            if not isinstance(body.get(f), str) or not body[f]:
                raise RequestError(f"'{f}' must be a non-empty string")
        return body

    async def load(request: Request) -> JSONResponse:
        body = await body_fields(request, ("lora_name", "lora_path"))
        table: AdapterTable = state.limits().loras
        name, path = body["lora_name"], body["lora_path"]
        victim = table.victim(name)
        victim_path = table.forget(victim) if victim else ""
        out = await state.bridge.lora(m.LoraReq(token=0, op="load", name=name, path=path,
                                                busy=sorted(set(table.paths) - {victim})))
        if out is None or not out.ok:
            if victim_path:
                table.paths[victim] = victim_path
            return fail(out.message, out.code) if out else fail("the worker is not running or did not answer", 503)
        table.forget(out.evicted)
        table.paths[name] = path
        table.touch(name)
        return JSONResponse({"success": True, "message": out.message, "evicted": out.evicted or None,
                             "load_seconds": round(out.seconds, 4)})

    async def unload(request: Request) -> JSONResponse:
        body = await body_fields(request, ("lora_name",))
        table: AdapterTable = state.limits().loras
        name = body["lora_name"]
        if table.inflight.get(name):
            return fail(f"LoRA adapter {name!r} is in use by {table.inflight[name]} request(s); retry when "
                        "they finish", 409)
        path = table.forget(name)
        out = await state.bridge.lora(m.LoraReq(token=0, op="unload", name=name))
        if out is None or not out.ok:
            if path:
                table.paths[name] = path
            return fail(out.message, out.code) if out else fail("the worker is not running or did not answer", 503)
        return JSONResponse({"success": True, "message": out.message})

    for path, fn, body, codes in (("/load_lora_adapter", load, LoadLoraRequest, (400, 401, 409, 503)),
                                  ("/unload_lora_adapter", unload, UnloadLoraRequest, (400, 401, 404, 409, 503))):
        for p in (path, "/v1" + path):  # the body is required (documented; read by body_fields)
            app.post(p, responses=api_schema.errors(*codes), openapi_extra=api_schema.body_docs(body))(fn)
