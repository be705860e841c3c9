"""Request parsing and validation (service/protocol.py): no processes, a toy tokenizer."""

from __future__ import annotations

import dataclasses

import pytest

from common.http import error_body
from service.protocol import (
    Limits,
    RequestError,
    parse_abort,
    parse_chat,
    parse_completion,
    parse_generate,
    parse_json_body,
)


class ToyTokenizer:
    """One id per character (ord % 1000); chat = role: content lines."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


TOK = ToyTokenizer()
COLO = Limits(role="colocated", context_length=64, vocab_size=1000, model_name="toy")
PREFILL = Limits(role="prefill", context_length=64, vocab_size=1000, model_name="toy")
BOOT = {"bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 2**63 - 1}


def bad(fn, body, limits=COLO, match: str = "") -> RequestError:  # noqa: ANN001
    with pytest.raises(RequestError, match=match) as ei:
        fn(body, TOK, limits)
    assert ei.value.status == 400 and ei.value.message
    return ei.value


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'"text"', b"\xff\xfe", b"null"])
def test_malformed_json_is_400(raw: bytes) -> None:
    with pytest.raises(RequestError) as ei:
        parse_json_body(raw)
    assert ei.value.status == 400


def test_generate_text_and_defaults() -> None:
    p = parse_generate({"text": "hello", "rid": "r1"}, TOK, COLO)
    assert p.kind == "generate" and p.req.rid == "r1"
    assert p.req.input_ids == TOK.encode("hello")
    assert p.req.sampling.max_new_tokens == 59  # default 128 capped to 64 - 5
    assert p.req.sampling.temperature == 1.0
    assert p.req.pd.room is None and not p.req.stream


def test_generate_input_ids_sampling_and_flags() -> None:
    body = {"input_ids": [1, 2, 3], "stream": True, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop": "x", "n": 1}}
    p = parse_generate(body, TOK, COLO)
    assert p.req.input_ids == [1, 2, 3] and p.req.stream and p.req.logprobs.on
    assert p.req.sampling.max_new_tokens == 4 and p.req.sampling.stop == ("x",)
    assert p.stop == ("x",) and p.logprobs
    assert len(p.req.rid) == 32  # generated uuid hex


@pytest.mark.parametrize("body,match", [
    ({}, "exactly one"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({"text": ""}, "empty"),
    ({"text": 5}, "string"),
    ({"text": ["a", "b"]}, "batched"),
    ({"input_ids": []}, "empty"),
    ({"input_ids": [1, "2"]}, "integer"),
    ({"input_ids": [1, True]}, "integer"),
    ({"input_ids": [5000]}, "vocabulary"),
    ({"input_ids": [[1, 2]]}, "batched"),
    ({"text": "a", "sampling_params": [1]}, "object"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 10**12}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "9"}}, "max_new_tokens"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "unknown"),
    ({"text": "a", "sampling_params": {"n": 0}}, "'n'"),
    ({"text": "a", "sampling_params": {"n": 65}}, "1..64"),
    ({"text": "a", "stream": "yes"}, "boolean"),
    ({"text": "a", "return_logprob": 1}, "boolean"),
    ({"text": "a", "rid": 7}, "rid"),
    ({"text": "x" * 64}, "context length"),
])
def test_generate_rejects(body: dict, match: str) -> None:
    bad(parse_generate, body, match=match)


def test_prompt_at_context_limit_minus_one_fits_with_one_token() -> None:
    p = parse_generate({"text": "x" * 63, "sampling_params": {"max_new_tokens": 50}}, TOK, COLO)
    assert p.req.sampling.max_new_tokens == 1


@pytest.mark.parametrize("patch,match", [
    ({"bootstrap_host": None}, "bootstrap_host"),
    ({"bootstrap_port": None, "bootstrap_room": None}, "bootstrap_port, bootstrap_room"),
    ({"bootstrap_host": ""}, "bootstrap_host"),
    ({"bootstrap_host": "a b"}, "bootstrap_host"),
    ({"bootstrap_host": 12}, "bootstrap_host"),
    ({"bootstrap_port": 0}, "bootstrap_port"),
    ({"bootstrap_port": 65536}, "bootstrap_port"),
    ({"bootstrap_port": "8998"}, "bootstrap_port"),
    ({"bootstrap_port": True}, "bootstrap_port"),
    ({"bootstrap_room": -1}, "bootstrap_room"),
    ({"bootstrap_room": 2**63}, "bootstrap_room"),
    ({"bootstrap_room": 1.5}, "bootstrap_room"),
])
def test_bootstrap_fields_required_and_checked_on_pd_roles(patch: dict, match: str) -> None:
    body = {"text": "hi", **BOOT, **patch}
    body = {k: v for k, v in body.items() if v is not None}
    bad(parse_generate, body, PREFILL, match=match)
    bad(parse_completion, {**body, "prompt": "hi"}, PREFILL, match=match)


def test_bootstrap_fields_pass_through_on_pd_and_are_ignored_colocated() -> None:
    p = parse_chat({"messages": [{"role": "user", "content": "hi"}], **BOOT}, TOK, PREFILL)
    assert (p.req.pd.host, p.req.pd.port, p.req.pd.room) == ("10.0.0.1", 8998, 2**63 - 1)
    p = parse_generate({"text": "hi", "bootstrap_port": "junk"}, TOK, COLO)
    assert p.req.pd.port is None


def test_prefill_here_hint_is_read_on_the_decode_only() -> None:
    decode = dataclasses.replace(PREFILL, role="decode")
    body = {"text": "hi", "pd_prefill_here": True, **BOOT}
    assert parse_generate(body, TOK, decode).req.pd.prefill_here
    assert not parse_generate(body, TOK, PREFILL).req.pd.prefill_here
    assert not parse_generate({**body, "pd_prefill_here": "yes"}, TOK, decode).req.pd.prefill_here


def test_completion_mapping() -> None:
    body = {"model": "toy", "prompt": "abc", "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
            "stop": ["\n", ""], "seed": 3, "n": 1, "echo": False, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}, "user": "u", "presence_penalty": 0}
    p = parse_completion(body, TOK, COLO)
    s = p.req.sampling
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed) == (7, 0.5, 0.9, 3)
    assert s.stop == ("\n",) and p.include_usage and p.logprobs and p.req.stream
    assert parse_completion({"prompt": [5, 6]}, TOK, COLO).req.input_ids == [5, 6]
    n3 = parse_completion({"prompt": "a", "n": 3}, TOK, COLO)
    assert n3.req.n == 3 and n3.choices == 3
    assert parse_completion({"prompt": "a", "n": 3, **BOOT}, TOK, PREFILL).choices == 1  # choice 0 only
    assert parse_generate({"text": "a", "sampling_params": {"n": 5}}, TOK, COLO).req.n == 5
    assert parse_completion({"prompt": ["ab"]}, TOK, COLO).req.input_ids == TOK.encode("ab")


@pytest.mark.parametrize("body,match", [
    ({"prompt": ""}, "empty"),
    ({"prompt": []}, "empty"),
    ({}, "required"),
    ({"prompt": ["a", "b"]}, "one prompt"),
    ({"prompt": {"a": 1}}, "string or a list"),
    ({"prompt": "a", "n": 0}, "'n'"),
    ({"prompt": "a", "n": 10000}, "1..64"),
    ({"prompt": "a", "n": True}, "'n'"),
    ({"prompt": "a", "n": 2.5}, "'n'"),  # a whole number as a float (2.0) is 2: see the test below
    ({"prompt": "a", "echo": 1}, "echo"),
    ({"prompt": "a", "logprobs": -1}, "logprobs"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "max_tokens": 0}, "max_new_tokens"),
    ({"prompt": "a", "max_tokens": -1}, "max_new_tokens"),
    ({"prompt": "a", "max_tokens": 10**9}, "max_new_tokens"),
    ({"prompt": "a", "max_tokens": 1.5}, "max_new_tokens"),
    ({"prompt": "a", "temperature": "x"}, "temperature"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "logprobs": 9}, "logprobs"),
    ({"prompt": "a", "stream": 1}, "boolean"),
    ({"prompt": "a", "model": 3}, "model"),
    ({"prompt": "a", "frequency_penalty": 3}, "frequency_penalty"),
    ({"prompt": "a", "presence_penalty": "x"}, "presence_penalty"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "logit_bias": {"1000": 5}}, "token id 1000 outside the vocabulary"),
    ({"prompt": "a", "logit_bias": {"abc": 5}}, "not a token id"),
    ({"prompt": "a", "logit_bias": {"3": 500}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": [1, 2]}, "logit_bias"),
    ({"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_new_tokens"),
])
def test_completion_rejects(body: dict, match: str) -> None:
    bad(parse_completion, body, match=match)


def test_chat_content_string_and_text_parts() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    p = parse_chat({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": parts}],
                    "max_completion_tokens": 3, "max_tokens": 9, "logprobs": True}, TOK, COLO)
    assert p.req.input_ids == TOK.encode("system: s\nuser: a\nb\nassistant: ")
    assert p.req.sampling.max_new_tokens == 3 and p.logprobs and p.kind == "chat"


@pytest.mark.parametrize("body,match", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user"}]}, "content"),
    ({"messages": [{"role": "user", "content": 5}]}, "content"),
    ({"messages": [{"role": "user", "content": ""}]}, "empty"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "image_url"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]}, "text"),
    ({"messages": ["hi"]}, "object"),
    ({"messages": [{"role": "user", "content": "x" * 80}]}, "context length"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs 'logprobs': true"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, r"0\.\.20"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": "5"}, "integer"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
     "response_format type 'xml' is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
     "needs 'json_schema'"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "'tool_choice' needs 'tools'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, r"names function 'g', which is not in"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "sometimes"}, "'tool_choice' must be"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
     r"tools\[0\].function.name"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_new_tokens"),
])
def test_chat_rejects(body: dict, match: str) -> None:
    bad(parse_chat, body, match=match)


def test_abort_parsing() -> None:
    assert parse_abort({"rid": "r"}).rid == "r"
    assert parse_abort({"bootstrap_room": 5}).room == 5
    assert parse_abort({"abort_all": True}).abort_all
    for body in ({}, {"rid": ""}, {"bootstrap_room": -1}, {"bootstrap_room": "5"}, {"abort_all": "yes"}):
        with pytest.raises(RequestError):
            parse_abort(body)


def test_error_body_shape() -> None:
    assert error_body("m", 400) == {"error": {"message": "m", "type": "invalid_request_error", "code": 400}}
    assert error_body("m", 503)["error"]["type"] == "server_error"


def test_penalties_bias_and_min_tokens_reach_the_sampling_params() -> None:
    p = parse_completion({"prompt": "a", "max_tokens": 8, "frequency_penalty": 0.5, "presence_penalty": -0.25,
                          "repetition_penalty": 1.2, "logit_bias": {"7": -100, "3": 2.5}, "min_tokens": 4},
                         TOK, COLO)
    sp = p.req.sampling
    assert (sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty) == (0.5, -0.25, 1.2)
    assert sp.logit_bias == ((3, 2.5), (7, -100.0)) and sp.min_new_tokens == 4 and sp.has_processors
    g = parse_generate({"text": "a", "sampling_params": {"min_new_tokens": 2, "repetition_penalty": 1.1,
                                                         "logit_bias": {"5": 1}}}, TOK, COLO)
    assert g.req.sampling.min_new_tokens == 2 and g.req.sampling.logit_bias == ((5, 1.0),)


def test_logprob_fields_reach_the_worker_request() -> None:
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 20},
                      TOK, COLO)
    assert (chat.req.logprobs.on, chat.req.logprobs.top_k, chat.req.logprobs.start_len) == (True, 20, -1)
    comp = parse_completion({"prompt": "abc", "logprobs": 3, "echo": True}, TOK, COLO)
    assert (comp.req.logprobs.top_k, comp.req.logprobs.start_len, comp.echo) == (3, 0, "abc")
    plain = parse_completion({"prompt": "abc", "echo": True}, TOK, COLO)  # echo alone: text, no logprobs
    assert not plain.req.logprobs.on and plain.req.logprobs.start_len == -1 and plain.echo == "abc"
    gen = parse_generate({"text": "abcd", "return_logprob": True, "top_logprobs_num": 4,
                          "logprob_start_len": 2}, TOK, COLO)
    assert (gen.req.logprobs.top_k, gen.req.logprobs.start_len) == (4, 2)
    off = parse_generate({"text": "abcd", "logprob_start_len": 2}, TOK, COLO)  # ignored without return_logprob
    assert not off.req.logprobs.on and off.req.logprobs.start_len == -1


@pytest.mark.parametrize("body,match", [
    ({"text": "abc", "top_logprobs_num": 3}, "needs 'return_logprob'"),
    ({"text": "abc", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": "abc", "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ({"text": "abc", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
])
def test_generate_rejects_bad_logprob_fields(body: dict, match: str) -> None:
    bad(parse_generate, body, match=match)


def test_a_resumed_stream_tells_the_sampler_how_many_prompt_ids_were_output() -> None:
    body = {"prompt": "a", "max_tokens": 10, "min_tokens": 5, "stream": True,
            "pd_resume": {"output_ids": [7, 8, 9], "id": "cmpl-x", "created": 1}}
    p = parse_completion(body, TOK, COLO)
    assert p.req.resumed_tokens == 3 and p.req.input_ids[-3:] == [7, 8, 9]
    assert (p.req.sampling.max_new_tokens, p.req.sampling.min_new_tokens) == (7, 2)


def test_nulls_mean_not_given_as_the_document_allows() -> None:
    """Bodies the schemathesis run on the router's document sent: null for every optional field."""
    from router.protocol import parse_request

    gen = {"input_ids": [1], "text": None, "sampling_params": None, "stream": None, "rid": None,
           "return_logprob": None, "top_logprobs_num": None, "logprob_start_len": None}
    assert parse_generate(gen, TOK, COLO).req.input_ids == [1]
    assert parse_request("/generate", gen).max_new_tokens == 128 and not parse_request("/generate", gen).stream
    chat = {"messages": [{"role": "assistant", "content": None, "tool_calls": None}, {"role": "user", "content": "x"}],
            "stream": None, "stream_options": None, "n": None, "tools": None, "tool_choice": None, "logprobs": None}
    assert parse_chat(chat, TOK, COLO).req.n == 1


def test_whole_numbers_sent_as_floats_are_integers() -> None:
    """JSON Schema's integers include 2.0 (schemathesis sends them; pydantic's lax mode and OpenAI take
    them): every integer field takes a float holding a whole number, and only that."""
    comp = parse_completion({"prompt": [1, 2.0], "n": 2.0, "max_tokens": 5.0, "seed": 7.0, "logprobs": 1.0}, TOK, COLO)
    assert comp.req.input_ids == [1, 2] and comp.req.n == 2 and comp.req.sampling.max_new_tokens == 5
    assert comp.req.sampling.seed == 7 and type(comp.req.sampling.seed) is int and comp.top_logprobs == 1
    gen = parse_generate({"input_ids": [3.0], "sampling_params": {"max_new_tokens": 4.0, "top_k": -1.0,
                                                                  "stop_token_ids": [2.0]},
                          "return_logprob": True, "logprob_start_len": 0.0, "priority": 2.0}, TOK, COLO)
    assert gen.req.sampling.max_new_tokens == 4 and gen.req.sampling.stop_token_ids == (2,)
    assert gen.req.logprobs.start_len == 0 and gen.req.options.priority == 2 and gen.req.sampling.top_k == -1
    assert parse_abort({"bootstrap_room": 5.0}).room == 5
    bad(parse_generate, {"input_ids": [3.5]}, match="input_ids")
    bad(parse_completion, {"prompt": "a", "max_tokens": 1e300}, match="max_new_tokens")


def test_a_capped_budget_keeps_the_params_valid() -> None:
    from engine.sampling.params import SamplingParams

    sp = SamplingParams(max_new_tokens=100, min_new_tokens=80)
    assert sp.within(200) is sp
    capped = sp.within(50)
    assert (capped.max_new_tokens, capped.min_new_tokens) == (50, 50) and sp.max_new_tokens == 100
