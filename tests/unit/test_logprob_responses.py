"""Logprobs as each API shows them (service/responses.py, service/logprob_views.py): OpenAI chat and
completions (echo, text offsets, streaming), SGLang's meta_info, and the PD split (a prefill answers
the prompt's logprobs only; the router joins them in front of its decode's)."""

from __future__ import annotations

import json

from router.protocol import merge_input_logprobs
from service.messages import TokenOut
from service.protocol import Limits, RequestError, parse_chat, parse_completion, parse_generate
from service.responses import RequestTracker, final_body, stream_chunks
from tests.unit.test_frontend_metrics import LIM, CharTok

TOK = CharTok()
A, B = ord("a"), ord("b")


def _tracker(parse, body: dict, limits: Limits = LIM) -> RequestTracker:  # noqa: ANN001
    return RequestTracker(parse({"rid": "r", **body}, TOK, limits), TOK, 0.0)


def _two_tokens(**kw) -> list[TokenOut]:  # noqa: ANN003
    """'h' then 'i', each with two alternatives (h|a, i|b)."""
    return [TokenOut(rid="r", new_token_ids=[ord("h")], new_logprobs=[-0.1],
                     new_top_logprobs=[[[ord("h"), A], [-0.1, -2.5]]], **kw),
            TokenOut(rid="r", new_token_ids=[ord("i")], new_logprobs=[-0.2],
                     new_top_logprobs=[[[ord("i"), B], [-0.2, -3.0]]], finished=True, finish_reason="length")]


def test_chat_top_logprobs_shape() -> None:
    tr = _tracker(parse_chat, {"messages": [{"role": "user", "content": "q"}], "logprobs": True, "top_logprobs": 2})
    for out in _two_tokens():
        tr.consume(out)
    content = final_body(tr)["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["h", "i"] and content[0]["logprob"] == -0.1
    assert content[0]["bytes"] == [ord("h")]
    assert content[0]["top_logprobs"] == [{"token": "h", "logprob": -0.1, "bytes": [ord("h")]},
                                          {"token": "a", "logprob": -2.5, "bytes": [A]}]


def test_completion_echo_logprobs_and_offsets() -> None:
    tr = _tracker(parse_completion, {"prompt": "ab", "logprobs": 2, "echo": True})
    outs = _two_tokens(input_start=0, input_logprobs=[-1.5], input_top_logprobs=[[[B, A], [-1.5, -1.7]]])
    for out in outs:
        tr.consume(out)
    choice = final_body(tr)["choices"][0]
    assert choice["text"] == "abhi"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "h", "i"]
    assert lp["token_logprobs"] == [None, -1.5, -0.1, -0.2]  # the first prompt token has none (OpenAI)
    assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"b": -1.5, "a": -1.7}
    assert lp["top_logprobs"][2] == {"h": -0.1, "a": -2.5}
    assert lp["text_offset"] == [0, 1, 2, 3]


def test_completion_stream_echo_then_deltas() -> None:
    tr = _tracker(parse_completion, {"prompt": "ab", "logprobs": 1, "echo": True, "stream": True})
    outs = _two_tokens(input_start=0, input_logprobs=[-1.5], input_top_logprobs=[[[B], [-1.5]]])
    events = []
    for i, out in enumerate(outs):
        events += [json.loads(e[6:]) for e in stream_chunks(tr, tr.consume(out), i == 0)]
    texts = [e["choices"][0]["text"] for e in events]
    assert texts == ["ab", "h", "i"]
    assert events[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.5]
    assert events[1]["choices"][0]["logprobs"]["text_offset"] == [2]
    assert events[2]["choices"][0]["logprobs"]["text_offset"] == [3]
    assert events[2]["choices"][0]["logprobs"]["top_logprobs"] == [{"i": -0.2, "b": -3.0}]


def test_generate_meta_info() -> None:
    tr = _tracker(parse_generate, {"text": "ab", "return_logprob": True, "top_logprobs_num": 2,
                                   "logprob_start_len": 1})
    for out in _two_tokens(input_start=1, input_logprobs=[-1.5], input_top_logprobs=[[[B, A], [-1.5, -1.7]]]):
        tr.consume(out)
    meta = final_body(tr)["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.1, ord("h"), None], [-0.2, ord("i"), None]]
    assert meta["output_top_logprobs"][1] == [[-0.2, ord("i"), None], [-3.0, B, None]]
    assert meta["input_token_logprobs"] == [[-1.5, B, None]]  # from position 1 on
    assert meta["input_top_logprobs"] == [[[-1.5, B, None], [-1.7, A, None]]]


def test_pd_prefill_prompt_joined_in_front_of_decode_answer() -> None:
    """Completions echo in PD: the prefill answers the prompt's entries only, the decode the output's
    (offsets after the echoed prompt); the router's merge gives the colocated answer."""
    body = {"prompt": "ab", "logprobs": 2, "echo": True}
    colo = _tracker(parse_completion, body)
    boot = {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}
    pre = _tracker(parse_completion, {**body, **boot}, Limits("prefill", 100, 1000, "m"))
    dec = _tracker(parse_completion, {**body, **boot}, Limits("decode", 100, 1000, "m"))
    prompt = {"input_start": 0, "input_logprobs": [-1.5], "input_top_logprobs": [[[B, A], [-1.5, -1.7]]]}
    first, second = _two_tokens(**prompt)
    for out in _two_tokens(**prompt):
        colo.consume(out)
    pre.consume(TokenOut(**{**first.__dict__, "finished": True, "finish_reason": "length"}))
    dec.consume(TokenOut(**{**first.__dict__, "input_start": -1, "input_logprobs": [], "input_top_logprobs": []}))
    dec.consume(second)
    p_body = final_body(pre)
    assert p_body["choices"][0]["logprobs"]["tokens"] == ["a", "b"]  # no output entries from a prefill
    merged = merge_input_logprobs("/v1/completions", p_body, final_body(dec))
    assert merged["choices"][0]["logprobs"] == final_body(colo)["choices"][0]["logprobs"]
    assert merged["choices"][0]["text"] == "abhi"


def test_bytes_of_a_token_holding_part_of_a_character() -> None:
    """A byte-level BPE token with half of 'é' (0xC3 0xA9) decodes to U+FFFD; its bytes are exact."""
    from service.logprob_views import BYTE_LEVEL, Pieces

    sym = {b: c for c, b in BYTE_LEVEL.items()}

    class HalfTok:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return {1: "\ufffd", 2: " a"}[ids[0]]

        def id_to_token(self, t: int) -> str:
            return {1: sym[0xC3], 2: sym[0x20] + "a"}[t]

    p = Pieces(HalfTok())
    assert p.bytes(1) == [0xC3] and p.bytes(2) == [0x20, ord("a")]


def test_echo_with_max_tokens_zero_is_the_prompt_only() -> None:
    """max_tokens 0 + echo (eval harnesses scoring a prompt): one token is generated, never shown."""
    body = {"prompt": "ab", "logprobs": 1, "echo": True, "max_tokens": 0}
    tr = _tracker(parse_completion, body)
    assert tr.parsed.echo_only and tr.parsed.req.sampling.max_new_tokens == 1
    prompt_lp = dict(input_start=0, input_logprobs=[-1.5], input_top_logprobs=[[[B], [-1.5]]])
    last = TokenOut(rid="r", new_token_ids=[ord("h")], new_logprobs=[-0.1], new_top_logprobs=[[[ord("h")], [-0.1]]],
                    finished=True, finish_reason="stop", completion_tokens=1, prompt_tokens=2, **prompt_lp)
    tr.consume(last)
    body_out = final_body(tr)
    choice = body_out["choices"][0]
    assert choice["text"] == "ab" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["a", "b"] and choice["logprobs"]["token_logprobs"] == [None, -1.5]
    assert body_out["usage"]["completion_tokens"] == 0
    st = _tracker(parse_completion, {**body, "stream": True})
    events = [json.loads(e[6:]) for e in stream_chunks(st, st.consume(last), True)]
    assert "".join(e["choices"][0]["text"] for e in events) == "ab"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    for bad in ({"prompt": "ab", "max_tokens": 0}, {"prompt": "ab", "max_tokens": 0, "echo": False}):
        try:
            parse_completion(bad, TOK, LIM)
        except RequestError as e:
            assert "max_new_tokens" in e.message
        else:
            raise AssertionError("max_tokens 0 without echo must be refused")
