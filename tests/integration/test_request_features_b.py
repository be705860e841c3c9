"""Issue 40, items 4-8, served: a colocated service and a prefill + decode behind the router (UCX, every
prompt disaggregated), all on a tiny random Llama carrying the embedded model's tokenizer, answer
/generate's `return_hidden_states`, `input_embeds` and `token_ids_logprob` and `POST /v1/embeddings`
(httpx and the openai client) equal to a transformers forward of the same weights within 1e-3, and
refuse bad values with a 400 naming the field; a colocated stub service (real frontend and
tokenizer, a worker that replays the prompt reversed, so its reply holds a `</think>` split over
tokens) splits chat replies with `--reasoning-parser deepseek-r1`, whole and streamed."""

from __future__ import annotations

import base64
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch
from pd_harness import call, start_service
from router_harness import Proc, free_port, start_router

from tests.stub_worker import make_tokenizer_dir
from tests.tiny_model import make_tiny_model

pytestmark = pytest.mark.slow

PROMPT = [9906, 1510, 314, 253, 1345, 28, 2072, 253, 6351, 1029, 354, 1076]
GEN = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
IDS = [5, 300, 49151]
TOL = 1e-3
ENGINE = ["--model", "", "--max-total-tokens", "4096", "--page-size", "4"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-tok")
    make_tokenizer_dir(model)
    make_tiny_model(model, vocab_size=49152, eos_token_id=2)  # its config.json over the tokenizer's
    engine = [*ENGINE[:1], str(model), *ENGINE[2:]]
    colo, _ = start_service("colocated", *engine)
    prefill, boot = start_service("prefill", *engine)
    decode, _ = start_service("decode", *engine, "--reasoning-parser", "deepseek-r1")
    port = free_port()
    stub = Proc("stub", [sys.executable, "-m", "tests.stub_worker", "--role", "colocated", "--model", str(model),
                         "--port", str(port), "--reasoning-parser", "deepseek-r1", "--log-level", "warning"],
                f"http://127.0.0.1:{port}", env={"PDSERVE_STUB_DELAY_S": "0.001"})
    router = start_router(["--prefill", f"{prefill.url},bootstrap_port={boot}", "--decode", decode.url])
    procs = [colo, prefill, decode, stub, router]
    try:
        for p in procs:
            p.wait_healthy(180)
        yield {"model": model, "colo": colo.url, "router": router.url, "stub": stub.url}
    finally:
        with ThreadPoolExecutor(len(procs)) as ex:  # each may take its drain grace: stop them together
            list(ex.map(lambda p: p.stop(5.0), procs))


@pytest.fixture(scope="module")
def hf(stack):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(stack["model"]), dtype=torch.float32).eval()


def _ref(hf, ids: list[int] | None = None, embeds: torch.Tensor | None = None):
    with torch.no_grad():
        out = hf(input_ids=None if ids is None else torch.tensor([ids]),
                 inputs_embeds=None if embeds is None else embeds[None], output_hidden_states=True)
    return out.hidden_states[-1][0], torch.log_softmax(out.logits[0].float(), dim=-1)


def _generate(url: str, **body) -> dict:  # noqa: ANN003
    status, out = call(url, "/generate", {"sampling_params": GEN, **body})
    assert status == 200, out
    return out


def _bad(url: str, path: str, body: dict, field: str) -> None:
    status, out = call(url, path, body)
    assert status == 400 and field in out["error"]["message"], (status, out)


@pytest.mark.parametrize("where", ["colo", "router"])
def test_hidden_states_and_token_ids_logprob(stack, hf, where: str) -> None:
    out = _generate(stack[where], input_ids=PROMPT, return_hidden_states=True, return_logprob=True,
                    logprob_start_len=0, token_ids_logprob=IDS)
    meta, ids = out["meta_info"], out["output_ids"]
    ref, lp = _ref(hf, PROMPT + ids)
    states = meta["hidden_states"]  # SGLang's shape: the prompt's [T][H], then one [H] per later token
    assert len(states) == len(ids) and len(states[0]) == len(PROMPT)
    ours = torch.tensor(states[0] + states[1:])
    assert (ours - ref[: ours.shape[0]]).abs().max().item() < TOL
    n = len(PROMPT)
    got_out = torch.tensor([[v for v, _, _ in step] for step in meta["output_token_ids_logprobs"]])
    assert [t for _, t, _ in meta["output_token_ids_logprobs"][0]] == IDS
    assert (got_out - lp[n - 1 : n - 1 + len(ids)][:, IDS]).abs().max().item() < TOL
    got_in = meta["input_token_ids_logprobs"]
    assert got_in[0] is None and len(got_in) == n
    assert (torch.tensor([[v for v, _, _ in s] for s in got_in[1:]]) - lp[: n - 1][:, IDS]).abs().max().item() < TOL


@pytest.mark.parametrize("where", ["colo", "router"])
def test_input_embeds(stack, hf, where: str) -> None:
    table = hf.get_input_embeddings().weight.detach()
    plain = _generate(stack[where], input_ids=PROMPT)
    same = _generate(stack[where], input_embeds=table[PROMPT].tolist())
    assert same["output_ids"] == plain["output_ids"]
    rand = torch.randn(7, table.shape[1], generator=torch.Generator().manual_seed(1)) * 0.3
    out = _generate(stack[where], input_embeds=rand.tolist(), return_hidden_states=True)
    ref, lp = _ref(hf, embeds=rand)
    assert out["output_ids"][0] == int(lp[-1].argmax())
    assert (torch.tensor(out["meta_info"]["hidden_states"][0]) - ref).abs().max().item() < TOL
    url = stack[where]
    _bad(url, "/generate", {"input_embeds": [[0.1] * 63]}, "hidden size is 64")
    _bad(url, "/generate", {"input_embeds": table[PROMPT].tolist(), "text": "hi"}, "'input_embeds'")
    _bad(url, "/generate", {"input_ids": PROMPT, "return_logprob": True, "token_ids_logprob": [49152]},
         "'token_ids_logprob'")


def _hf_embedding(hf, ids: list[int], dims: int = 0) -> torch.Tensor:
    v = _ref(hf, ids)[0][-1]
    return torch.nn.functional.normalize(v[:dims] if dims else v, dim=0)


@pytest.mark.parametrize("where", ["colo", "router"])
def test_embeddings(stack, hf, where: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(stack["model"]))
    client = openai.OpenAI(base_url=stack[where] + "/v1", api_key="none")
    texts = ["The lighthouse keeper climbed the stairs.", "Hello"]
    res = client.embeddings.create(input=texts, model="m")  # the client asks for base64
    want = [_hf_embedding(hf, tok.encode(t, add_special_tokens=False)) for t in texts]
    assert [d.index for d in res.data] == [0, 1]
    for d, w in zip(res.data, want):
        assert (torch.tensor(d.embedding) - w).abs().max().item() < TOL
    assert res.usage.prompt_tokens == sum(len(tok.encode(t, add_special_tokens=False)) for t in texts)
    r = httpx.post(stack[where] + "/v1/embeddings", json={"input": [PROMPT, PROMPT[:3]], "dimensions": 16,
                                                          "encoding_format": "float"}, timeout=60).json()
    vec = torch.tensor(r["data"][0]["embedding"])
    assert vec.shape == (16,) and abs(vec.norm().item() - 1) < 1e-5
    assert (vec - _hf_embedding(hf, PROMPT, 16)).abs().max().item() < TOL
    assert (torch.tensor(r["data"][1]["embedding"]) - _hf_embedding(hf, PROMPT[:3], 16)).abs().max().item() < TOL
    raw = httpx.post(stack[where] + "/v1/embeddings", json={"input": "Hello", "encoding_format": "base64"},
                     timeout=60).json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(raw), "<f4"), want[1].numpy(), atol=TOL)
    _bad(stack[where], "/v1/embeddings", {"input": "x", "dimensions": 65}, "'dimensions'")
    _bad(stack[where], "/v1/embeddings", {"input": [[1, 49152]]}, "'input[0]'")


def test_reasoning_split_whole_and_streamed(stack) -> None:
    """The stub replays the prompt reversed: 'x>think</y' in the message comes back as 'y</think>x'."""
    from service.reasoning import split
    from service.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": "first x>think</y last"}]
    ids = load_tokenizer(stack["model"]).apply_chat_template(messages)
    plain = _generate(stack["stub"], input_ids=ids, sampling_params={"max_new_tokens": 40})["text"]
    want = split(plain, "deepseek-r1")
    assert "</think>" in plain and want[0] and want[1]
    client = openai.OpenAI(base_url=stack["stub"] + "/v1", api_key="none")
    msg = client.chat.completions.create(model="m", messages=messages, max_tokens=40).choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == want
    think = content = ""
    for chunk in client.chat.completions.create(model="m", messages=messages, max_tokens=40, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        extra = (delta.model_extra or {}) if delta else {}
        assert not (extra.get("reasoning_content") and delta.content)  # separate deltas
        think += extra.get("reasoning_content") or ""
        content += (delta.content or "") if delta else ""
    assert (think, content) == want



def test_reasoning_through_the_router(stack) -> None:
    """The decode (--reasoning-parser deepseek-r1) splits what the router relays: the tiny model never
    closes a think tag, so its whole reply is reasoning, equal to the colocated service's content."""
    messages = [{"role": "user", "content": "Tell me a story."}]
    body = {"model": "m", "messages": messages, "max_tokens": 6, "temperature": 0}
    plain = openai.OpenAI(base_url=stack["colo"] + "/v1", api_key="none").chat.completions.create(**body)
    client = openai.OpenAI(base_url=stack["router"] + "/v1", api_key="none")
    msg = client.chat.completions.create(**body).choices[0].message
    assert plain.choices[0].message.content and msg.model_extra["reasoning_content"] == plain.choices[0].message.content
    assert msg.content == ""
    streamed = [c.choices[0].delta for c in client.chat.completions.create(**body, stream=True) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in streamed) == msg.model_extra[
        "reasoning_content"]
    assert not any(d.content for d in streamed)
