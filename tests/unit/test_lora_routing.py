"""LoRA bookkeeping without processes (issue 41): the router's adapter-aware choice and /v1/models merge,
the frontend's adapter table (resolution and its errors, in-flight counts, LRU victim), the per-batch
cap's split and the flags' validation."""

from __future__ import annotations

import httpx
import pytest

from engine.config import EngineConfig
from engine.forward.forward_batch import split_by_adapters
from router import lora
from router.config import WorkerSpec
from router.protocol import parse_request
from router.registry import Worker
from service.lora import AdapterTable, ModelNotFound
from service.protocol import RequestError


def _worker(url: str, loras: set[str]) -> Worker:
    return Worker(WorkerSpec(url, "decode"), healthy=True, loras=frozenset(loras))


def test_router_prefers_workers_holding_the_adapter():
    a, b = _worker("http://a", {"x"}), _worker("http://b", {"x", "y"})
    assert lora.prefer([a, b], "y") == [b]
    assert lora.prefer([a, b], "z") == [a, b]  # nobody has it: the worker answers (404/400/412)
    assert lora.prefer([a, b], "") == [a, b]
    req = parse_request("/generate", {"input_ids": [1, 2], "lora_path": "y"})
    assert lora.adapter_of(req) == "y"
    assert lora.adapter_of(parse_request("/v1/completions", {"model": "x", "prompt": "hi"})) == "x"
    ok = httpx.Response(200, json={"status": "ok", "lora_adapters": ["x", 3]})
    assert lora.adapters_of(ok) == {"x"} and lora.adapters_of(httpx.Response(200, text="ok")) == frozenset()
    merged = lora.merge_models([{"data": [{"id": "base"}, {"id": "x"}]}, {"data": [{"id": "base"}, {"id": "y"}]}])
    assert [c["id"] for c in merged["data"]] == ["base", "x", "y"]


def test_adapter_table_resolution_and_lru_victim():
    t = AdapterTable()
    t.sync({"lora_adapters": {"x": "/p/x", "y": "/p/y"}, "lora_slots": 2})
    assert t.resolve("generate", {"lora_path": "x"}, "base", "colocated") == "x"
    assert t.resolve("completion", {"model": "base"}, "base", "colocated") == ""
    assert t.resolve("chat", {"model": "y"}, "base", "prefill") == "y"
    with pytest.raises(ModelNotFound) as e:
        t.resolve("chat", {"model": "nope"}, "base", "colocated")
    assert e.value.status == 404 and e.value.body()["error"]["code"] == "model_not_found"
    with pytest.raises(RequestError, match="'lora_path'.*nope"):
        t.resolve("generate", {"lora_path": "nope"}, "base", "colocated")
    with pytest.raises(RequestError) as e:
        t.resolve("generate", {"lora_path": "nope"}, "base", "decode")
    assert e.value.status == 412 and "'nope'" in e.value.message
    t.acquire("x")
    t.acquire("y")
    t.release("y")
    assert t.victim("z") == "y"  # x is in use
    t.acquire("y")
    assert t.victim("z") == ""  # every adapter in use: the worker refuses with 409
    t.release("x")
    assert t.victim("z") == "x" and t.victim("x") == ""
    off = AdapterTable()
    off.sync({"lora_slots": 0})
    assert off.resolve("chat", {"model": "anything"}, "base", "colocated") == ""  # LoRA off: model unchecked


def test_split_by_adapters_and_flags():
    names = ["a", "", "b", "a", "c", ""]  # each segment's adapter
    assert split_by_adapters(names, 3) == [[0, 1, 2, 3, 4, 5]]
    groups = split_by_adapters(names, 2)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(len({names[i] for i in g} - {""}) <= 2 for g in groups)
    for field, bad, flag in (("max_lora_rank", 0, "--max-lora-rank"), ("max_loras_per_batch", 0,
                                                                        "--max-loras-per-batch"),
                             ("max_loaded_loras", -1, "--max-loaded-loras")):
        with pytest.raises(ValueError, match=flag):
            EngineConfig(**{field: bad})
