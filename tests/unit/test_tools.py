"""Structured output and tools at the edge (service/protocol.py, service/tools.py,
service/responses.py) with the embedded model's tokenizer and a real grammar compiler: bad grammars
are 400s naming the problem; response_format and tool_choice become the right grammar; replies that
are tool calls become OpenAI `tool_calls`, whole and streamed."""

from __future__ import annotations

import json

import pytest

from engine.models.embedded import resolve_model_path
from engine.sampling.grammar import Grammars
from service.messages import TokenOut
from service.protocol import Limits, RequestError, parse_chat, parse_completion, parse_generate
from service.responses import RequestTracker, final_body, stream_chunks
from service.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
MSGS = [{"role": "user", "content": "What's the weather in Paris?"}]


@pytest.fixture(scope="module")
def tok():  # noqa: ANN201
    return load_tokenizer(resolve_model_path("embedded"))


@pytest.fixture(scope="module")
def limits(tok) -> Limits:  # noqa: ANN001
    g = Grammars(tok.path, 49152, (2,))
    return Limits(role="colocated", context_length=2048, vocab_size=49152, model_name="m", grammars=g)


@pytest.mark.parametrize("fn,body,match", [
    (parse_generate, {"text": "x", "sampling_params": {"regex": "[a-"}}, r"invalid regex: .*Unclosed '\['"),
    (parse_generate, {"text": "x", "sampling_params": {"json_schema": "{bad"}}, "invalid json_schema: .*syntax"),
    (parse_generate, {"text": "x", "sampling_params": {"ebnf": "root ::= nope"}}, 'Rule "nope" is not defined'),
    (parse_generate, {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "at most one"),
    (parse_completion, {"prompt": "x", "response_format": {"type": "json_schema",
                                                           "json_schema": {"name": "s", "schema": {"type": "nah"}}}},
     'Unsupported type "nah"'),
    (parse_chat, {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "bogus"}}}}}],
        "tool_choice": "required"}, 'Unsupported type "bogus"'),
])
def test_bad_grammar_is_a_400_naming_it(tok, limits: Limits, fn, body: dict, match: str) -> None:  # noqa: ANN001
    with pytest.raises(RequestError, match=match) as ei:
        fn(body, tok, limits)
    assert ei.value.status == 400


def test_response_format_and_generate_params_set_the_grammar(tok, limits: Limits) -> None:  # noqa: ANN001
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = parse_chat({"messages": MSGS, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "s", "schema": schema}}}, tok, limits)
    assert json.loads(p.req.sampling.json_schema) == schema
    p = parse_completion({"prompt": "x", "response_format": {"type": "json_object"}}, tok, limits)
    assert json.loads(p.req.sampling.json_schema) == {"type": "object"}
    p = parse_generate({"text": "x", "sampling_params": {"json_schema": schema}}, tok, limits)
    assert json.loads(p.req.sampling.json_schema) == schema
    text = parse_chat({"messages": MSGS, "response_format": {"type": "text"}}, tok, limits)
    assert text.req.sampling.json_schema is None


def test_tool_choice_renders_tools_and_constrains(tok, limits: Limits) -> None:  # noqa: ANN001
    plain = parse_chat({"messages": MSGS}, tok, limits)
    auto = parse_chat({"messages": MSGS, "tools": [WEATHER, CLOCK]}, tok, limits)
    none = parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": "none"}, tok, limits)
    assert none.tools is None and none.req.input_ids == plain.req.input_ids
    assert auto.tools.choice == "auto" and auto.req.sampling.json_schema is None
    prompt = tok.decode(auto.req.input_ids, skip_special_tokens=False)
    assert "get_weather" in prompt and "You can call functions" in prompt and MSGS[0]["content"] in prompt
    req = parse_chat({"messages": MSGS, "tools": [WEATHER, CLOCK], "tool_choice": "required"}, tok, limits)
    assert [s["properties"]["name"]["const"] for s in json.loads(req.req.sampling.json_schema)["anyOf"]] == \
        ["get_weather", "get_time"]
    named = parse_chat({"messages": MSGS, "tools": [WEATHER, CLOCK],
                        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, tok, limits)
    s = json.loads(named.req.sampling.json_schema)
    assert s["properties"]["name"] == {"const": "get_weather"} and s["properties"]["arguments"]["required"] == ["city"]
    with pytest.raises(RequestError, match="cannot be combined"):
        parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": "required",
                    "response_format": {"type": "json_object"}}, tok, limits)
    history = [*MSGS, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    p = parse_chat({"messages": history, "tools": [WEATHER]}, tok, limits)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in tok.decode(p.req.input_ids)


def _replay(tok, parsed, text: str, pieces: int = 3) -> tuple[dict, list[dict]]:  # noqa: ANN001
    """The final body and the streamed events of a reply of `text` (in `pieces` token batches)."""
    ids = tok.encode(text) + [2]
    step = max(1, len(ids) // pieces)
    batches = [ids[i:i + step] for i in range(0, len(ids), step)]
    whole, streamed = RequestTracker(parsed, tok, 0.0), RequestTracker(parsed, tok, 0.0)
    events: list[dict] = []
    for k, b in enumerate(batches):
        last = k == len(batches) - 1
        out = TokenOut(rid="r", new_token_ids=b, finished=last, finish_reason="stop" if last else None,
                       matched_stop=2 if last else None)
        whole.consume(out)
        delta = streamed.consume(out)
        events += [json.loads(c[6:]) for c in stream_chunks(streamed, delta, k == 0)]
    return final_body(whole), events


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_tool_call_replies_become_tool_calls(tok, limits: Limits, choice: str) -> None:  # noqa: ANN001
    parsed = parse_chat({"messages": MSGS, "tools": [WEATHER], "tool_choice": choice, "stream": True}, tok, limits)
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    for text in (call, f"<tool_call>\n{call}\n</tool_call>") if choice == "auto" else (call,):
        body, events = _replay(tok, parsed, text)
        choice0 = body["choices"][0]
        assert choice0["finish_reason"] == "tool_calls" and choice0["message"]["content"] is None
        (tc,) = choice0["message"]["tool_calls"]
        assert tc["type"] == "function" and tc["id"].startswith("call_")
        assert tc["function"]["name"] == "get_weather" and json.loads(tc["function"]["arguments"]) == {"city": "Paris"}
        deltas = [e["choices"][0]["delta"] for e in events]
        assert not any(d.get("content") for d in deltas)  # nothing of the call leaks as content
        (streamed,) = [d["tool_calls"] for d in deltas if "tool_calls" in d]
        assert streamed[0]["index"] == 0 and streamed[0]["function"]["name"] == "get_weather"
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_auto_plain_reply_is_content_and_streams(tok, limits: Limits) -> None:  # noqa: ANN001
    parsed = parse_chat({"messages": MSGS, "tools": [WEATHER], "stream": True}, tok, limits)
    text = "It is sunny in Paris today, I think."
    body, events = _replay(tok, parsed, text, pieces=4)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text}
    assert body["choices"][0]["finish_reason"] == "stop"
    contents = [e["choices"][0]["delta"].get("content") for e in events]
    assert "".join(c for c in contents if c) == text and sum(1 for c in contents if c) > 1  # streamed, not held
    # a JSON reply that is no call (unknown function) is content too, released at the end
    body, _ = _replay(tok, parsed, '{"name": "launch_rocket", "arguments": {}}')
    assert body["choices"][0]["message"]["content"].startswith('{"name": "launch_rocket"')
