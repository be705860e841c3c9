"""Mid-stream migration contract between a service and the router, no processes: the service's stream
events carry token ids the router's StreamLedger reads and strips; the resumed body the ledger builds
makes a service continue the same stream (prompt + ids so far, the rest of the budget, same id)."""

from __future__ import annotations

import json

import pytest

from router.migration import StreamLedger, migratable
from router.protocol import parse_request
from service.messages import TokenOut
from service.protocol import Limits, RequestError, parse_chat, parse_completion, parse_generate
from service.responses import RequestTracker, stream_chunks


class CharTok:
    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


TOK = CharTok()
LIM = Limits(role="decode", context_length=100, vocab_size=1000, model_name="m")
BOOT = {"bootstrap_host": "h", "bootstrap_port": 1, "bootstrap_room": 5}


def _events(tr: RequestTracker, text: str, first: bool, **kw) -> list[bytes]:  # noqa: ANN003
    out = TokenOut(rid=tr.rid, new_token_ids=TOK.encode(text), **kw)
    return [e.removesuffix(b"\n\n") for e in stream_chunks(tr, tr.consume(out), first)]  # as SSEReader gives them


def _obj(raw: bytes) -> dict:
    return json.loads(raw.removeprefix(b"data: "))


def test_ids_go_to_the_router_and_a_resumed_stream_continues_the_first():
    body = {"prompt": "q", "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    req = parse_request("/v1/completions", body)
    assert migratable(req, 2) and not migratable(req, 0)
    assert not migratable(parse_request("/v1/completions", {**body, "n": 2}), 2)  # choices interleave
    tr = RequestTracker(parse_completion({**body, **BOOT, "pd_token_ids": True}, TOK, LIM), TOK, 0.0)
    (first,) = _events(tr, "ab", first=True)
    ledger = StreamLedger(first, limit=2)
    relayed = ledger.take(first)
    assert ledger.ids == [97, 98] and b"pd_token_ids" not in relayed and not ledger.finished
    assert _obj(relayed)["choices"][0]["text"] == "ab" and ledger.response_id == _obj(first)["id"]
    # the decode dies; the router re-issues the request, the next decode continues the stream
    resumed = ledger.resumed(req)
    p2 = parse_completion({**resumed.body, **BOOT, "pd_token_ids": True}, TOK, LIM)
    assert p2.req.input_ids == [ord("q"), 97, 98] and p2.req.sampling.max_new_tokens == 4
    tr2 = RequestTracker(p2, TOK, 0.0)
    events = _events(tr2, "cdef", first=True, finished=True, finish_reason="length", prompt_tokens=3,
                     completion_tokens=4)
    objs = [_obj(ledger.take(e)) for e in events]
    assert "".join(o["choices"][0]["text"] for o in objs if o["choices"]) == "cdef"
    assert ledger.ids == TOK.encode("abcdef") and ledger.finished and not ledger.can_migrate()
    assert {o["id"] for o in objs} == {ledger.response_id} and {o["created"] for o in objs} == {ledger.created}
    assert objs[-1]["usage"]["prompt_tokens"] == 1 and objs[-1]["usage"]["completion_tokens"] == 6
    with pytest.raises(RequestError, match="nothing left"):
        parse_completion({**body, **BOOT, "pd_resume": {"output_ids": TOK.encode("abcdef")}}, TOK, LIM)


def test_resumed_chat_sends_no_second_role_chunk_and_the_limit_holds():
    body = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 8, "stream": True,
            "pd_resume": {"output_ids": [120], "id": "chatcmpl-1", "created": 7}}
    tr = RequestTracker(parse_chat({**body, **BOOT}, TOK, LIM), TOK, 0.0)
    (event,) = _events(tr, "y", first=True)
    assert _obj(event)["choices"][0]["delta"] == {"content": "y"} and _obj(event)["id"] == "chatcmpl-1"
    ledger = StreamLedger(b'data: {"id": "chatcmpl-1", "created": 7, "choices": []}', limit=1)
    assert ledger.can_migrate()
    ledger.resumed(parse_request("/v1/chat/completions", body))
    assert not ledger.can_migrate()


def test_generate_stream_migrates_with_cumulative_text_and_ids():
    body = {"text": "q", "sampling_params": {"max_new_tokens": 5}, "stream": True}
    req = parse_request("/generate", body)
    assert migratable(req, 2)
    tr = RequestTracker(parse_generate({**body, **BOOT, "pd_token_ids": True}, TOK, LIM), TOK, 0.0)
    (first,) = _events(tr, "ab", first=True)
    ledger = StreamLedger(first, limit=2)
    relayed = _obj(ledger.take(first))
    assert ledger.ids == [97, 98] and "pd_token_ids" not in relayed and not ledger.finished
    assert relayed["text"] == "ab" and relayed["output_ids"] == [97, 98]
    resumed = ledger.resumed(req)
    p2 = parse_generate({**resumed.body, **BOOT, "pd_token_ids": True}, TOK, LIM)
    assert p2.req.input_ids == [ord("q"), 97, 98] and p2.req.sampling.max_new_tokens == 3
    tr2 = RequestTracker(p2, TOK, 0.0)
    (mid,) = _events(tr2, "c", first=True)
    assert _obj(ledger.take(mid))["text"] == "abc" and not ledger.finished  # cumulative across the legs
    (last,) = _events(tr2, "de", first=False, finished=True, finish_reason="length", prompt_tokens=3,
                      completion_tokens=3)
    end = _obj(ledger.take(last))
    assert end["text"] == "abcde" and end["output_ids"] == TOK.encode("abcde")
    assert end["meta_info"]["prompt_tokens"] == 1 and end["meta_info"]["completion_tokens"] == 5
    assert ledger.ids == TOK.encode("abcde") and ledger.finished and not ledger.can_migrate()
