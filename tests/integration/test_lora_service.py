"""LoRA through real services (issue 41): a tiny random Llama with PEFT adapters made by `peft`.

Stacks (module-scoped, started at once): a colocated service (adapters qv and all preloaded, 3
slots); a prefill and decode D1 holding both adapters, a decode D2 holding only qv, and the router
over all three. Checked: /generate `lora_path` and /v1 `model` pick the same adapter; unknown names
are 404 model_not_found (/v1) or 400 naming lora_path; /v1/models lists adapters (the router's too);
cached prefixes never cross adapters; load/unload at run time (409 while in use, LRU eviction of the
least recently used idle adapter) while requests run, every pool back to 0 after; PD through the
router equals colocated for the base and each adapter (the router picks the decode holding the
adapter); a decode lacking a room's adapter answers 412 naming it.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import sys
from pathlib import Path

import httpx
import pytest
from pd_harness import call, start_service, wait_idle
from router_harness import start_router, wait_for

from common.procs import stop_all

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.stub_worker import make_tokenizer_dir  # noqa: E402
from tests.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

NEW = 10
ADAPTERS = {"qv": (4, ["q_proj", "v_proj"]), "all": (8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"]),
            "mlp": (8, ["gate_proj", "down_proj"]), "o": (2, ["o_proj"])}


def _make_adapters(model: Path, root: Path) -> dict[str, Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = {}
    for i, (name, (r, targets)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
        peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
        out[name] = root / name
        peft.save_pretrained(str(out[name]))
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(make_tokenizer_dir(root / "model"))
    paths = _make_adapters(model, root)
    both = ["--lora-paths", f"qv={paths['qv']}", f"all={paths['all']}"]
    common = ["--model", str(model), "--page-size", "8"]
    procs: dict = {}
    try:
        # slowed forwards (slow_worker.STEP_S each): a 400-token request holds its adapter 2 s or more
        procs["colo"], _ = start_service("colocated", *common, *both, "--max-loaded-loras", "3",
                                         module="tests.integration.slow_worker")
        procs["p"], boot = start_service("prefill", *common, *both)
        procs["d1"], _ = start_service("decode", *common, *both)
        procs["d2"], _ = start_service("decode", *common, "--lora-paths", f"qv={paths['qv']}")
        for p in procs.values():
            p.wait_healthy(300)
        procs["router"] = start_router(["--prefill", procs["p"].url, "--decode", procs["d1"].url,
                                        "--decode", procs["d2"].url])
        procs["router"].wait_healthy(60)
        yield {"procs": procs, "paths": paths, "boot": boot}
    finally:
        stop_all(list(procs.values()), 20)
        for p in procs.values():
            p.stop()


def _prompt(seed: int, n: int = 21) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(1, 250) for _ in range(n)]


def _gen(url: str, ids: list[int], lora: str | None = None, new: int = NEW, **extra: object) -> tuple[int, dict]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            **extra}
    if lora is not None:
        body["lora_path"] = lora
    return call(url, "/generate", body)  # type: ignore[return-value]


def _ids(res: tuple[int, dict]) -> list[int]:
    assert res[0] == 200, res
    return res[1]["output_ids"]


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def test_adapter_by_lora_path_and_by_model_agree(stack: dict) -> None:
    url = stack["procs"]["colo"].url
    ids = _prompt(1)
    base, qv, al = (_ids(_gen(url, ids, name)) for name in (None, "qv", "all"))
    assert len({tuple(base), tuple(qv), tuple(al)}) == 3, "each adapter must change the greedy tokens"
    st, body = call(url, "/v1/completions", {"model": "all", "prompt": ids, "max_tokens": NEW, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 0})
    assert st == 200 and body["model"] == "all", body
    assert body["choices"][0]["logprobs"]["tokens"] and len(body["choices"][0]["logprobs"]["tokens"]) == NEW
    served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    st, body = call(url, "/v1/completions", {"model": served, "prompt": ids, "max_tokens": 3})
    assert st == 200 and body["model"] == served, body  # the base model by its own name


def test_unknown_adapter_is_refused_naming_it(stack: dict) -> None:
    url = stack["procs"]["colo"].url
    st, body = call(url, "/v1/completions", {"model": "nope", "prompt": _prompt(2), "max_tokens": 2})
    assert st == 404 and body["error"]["code"] == "model_not_found" and "nope" in body["error"]["message"], body
    st, body = _gen(url, _prompt(2), "nope")
    assert st == 400 and "lora_path" in body["error"]["message"] and "nope" in body["error"]["message"], body


def test_models_list_adapters(stack: dict) -> None:
    for proc, want in ((stack["procs"]["colo"], {"qv", "all"}), (stack["procs"]["router"], {"qv", "all"})):
        ids = {c["id"] for c in httpx.get(proc.url + "/v1/models", timeout=10).json()["data"]}
        assert want <= ids and len(ids) == len(want) + 1, ids


def test_cached_prefixes_never_cross_adapters(stack: dict) -> None:
    url = stack["procs"]["colo"].url
    ids = _prompt(3, 40)
    _gen(url, ids, "qv")
    assert _gen(url, ids, "qv")[1]["meta_info"]["cached_tokens"] > 0  # the same adapter reuses its prefix
    for other in ("all", None):
        assert _gen(url, ids, other)[1]["meta_info"]["cached_tokens"] == 0, other


def test_load_unload_under_load(stack: dict) -> None:
    url, paths = stack["procs"]["colo"].url, stack["paths"]
    r = _post(url, "/load_lora_adapter", {"lora_name": "mlp", "lora_path": str(paths["mlp"])})
    assert r.status_code == 200 and r.json()["evicted"] is None, r.text
    assert r.json()["load_seconds"] > 0
    with cf.ThreadPoolExecutor(6) as ex:
        long = ex.submit(_gen, url, _prompt(4), "mlp", 400)  # holds "mlp" while the rest runs
        wait_for(lambda: httpx.get(url + "/server_info", timeout=10).json()["in_flight"] >= 1, 60, "the long request")
        others = [ex.submit(_gen, url, _prompt(5 + i), name) for i, name in enumerate(["qv", "all", None, "qv"])]
        busy = _post(url, "/unload_lora_adapter", {"lora_name": "mlp"})
        assert busy.status_code == 409 and "mlp" in busy.text, busy.text  # the long request still uses it
        for f in others:  # done: "qv" and "all" are idle again ("mlp" stays held by the long request)
            assert f.result()[0] == 200
        _gen(url, _prompt(9), "all")  # "qv" is now the least recently used idle adapter
        assert not long.done(), "the long request ended before the load: raise slow_worker.STEP_S"
        r = _post(url, "/load_lora_adapter", {"lora_name": "o", "lora_path": str(paths["o"])})
        assert r.status_code == 200, r.text
        assert r.json()["evicted"] == "qv", r.json()
        assert long.result()[0] == 200
    assert _post(url, "/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 200
    assert _post(url, "/unload_lora_adapter", {"lora_name": "mlp"}).status_code == 404
    assert _gen(url, _prompt(10), "mlp")[0] == 400
    assert _post(url, "/load_lora_adapter", {"lora_name": "x", "lora_path": "/nonexistent"}).status_code == 400
    assert _post(url, "/load_lora_adapter", {"lora_name": "x"}).status_code == 400  # names lora_path
    for name, path in (("qv", paths["qv"]), ("all", paths["all"])):  # restore for the tests after
        _post(url, "/unload_lora_adapter", {"lora_name": "o"})
        assert _post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}).status_code == 200
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    assert wait_idle(stack["procs"]["colo"])["kv_used_tokens"] == 0


def test_pd_through_router_equals_colocated(stack: dict) -> None:
    procs = stack["procs"]
    for i, name in enumerate([None, "qv", "all", "all", "all"]):  # "all" only on d1: the router must pick it
        ids = _prompt(20 + i)
        want = _ids(_gen(procs["colo"].url, ids, name))
        assert _ids(_gen(procs["router"].url, ids, name)) == want, name
    st, body = call(procs["router"].url, "/v1/completions", {"model": "all", "prompt": _prompt(20), "max_tokens": NEW,
                                                            "temperature": 0, "ignore_eos": True})
    assert st == 200 and body["model"] == "all", body
    for p in ("p", "d1", "d2"):
        wait_idle(procs[p])


def test_decode_lacking_the_adapter_answers_412(stack: dict) -> None:
    d2 = stack["procs"]["d2"]
    st, body = _gen(d2.url, _prompt(30), "all", bootstrap_host="127.0.0.1", bootstrap_port=stack["boot"],
                    bootstrap_room=12345)
    assert st == 412 and "'all'" in body["error"]["message"], body
