"""Issue 40, no processes: the reasoning splitter (service/reasoning.py) at every chunking of a reply,
chat answers and stream deltas with `--reasoning-parser` (a char-level tokenizer forces the token
stream: the tiny models never write think tags), and the 400s of /generate's model extras and of
/v1/embeddings bodies, each naming its field."""

from __future__ import annotations

import json

import pytest

from service.embeddings import EmbedError
from service.embeddings import parse as parse_embeddings
from service.messages import TokenOut
from service.protocol import Limits, RequestError, parse_chat, parse_generate
from service.reasoning import ReasoningSplitter, split
from service.responses import RequestTracker, openai_body, stream_chunks

CASES = [  # (style, reply, reasoning, content)
    ("qwen3", "<think>step one</think>The answer", "step one", "The answer"),
    ("qwen3", "\n <think>a<b</think>\n\nc</think>", "a<b", "\n\nc</think>"),  # later tags are text
    ("qwen3", "no thinking here <think>x</think>", "", "no thinking here <think>x</think>"),
    ("qwen3", "<think>never closed", "never closed", ""),
    ("qwen3", "<thin", "", "<thin"),  # ended before the tag completed: plain text
    ("deepseek-r1", "ponder</think>Result", "ponder", "Result"),
    ("deepseek-r1", "<think>ponder</think>Result", "ponder", "Result"),
    ("deepseek-r1", "only thoughts </thi", "only thoughts </thi", ""),
]


@pytest.mark.parametrize("style,reply,reasoning,content", CASES)
def test_split_at_every_chunking(style: str, reply: str, reasoning: str, content: str) -> None:
    assert split(reply, style) == (reasoning, content)
    for size in range(1, len(reply) + 1):
        s, got_r, got_c = ReasoningSplitter(style), "", ""
        for i in range(0, len(reply), size):
            r, c = s.push(reply[i : i + size])
            got_r, got_c = got_r + r, got_c + c
        r, c = s.push("", final=True)
        assert (got_r + r, got_c + c) == (reasoning, content), f"chunks of {size}"


def test_unknown_style_is_refused() -> None:
    with pytest.raises(ValueError, match="reasoning parser"):
        ReasoningSplitter("r2")


class CharTok:
    vocab_size = 1000

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


TOK = CharTok()
LIM = Limits(role="colocated", context_length=200, vocab_size=1000, model_name="m", hidden_size=4)
REPLY = "<think>I reason</think>Final."


def _chat(stream: bool) -> RequestTracker:
    parsed = parse_chat({"messages": [{"role": "user", "content": "q"}], "stream": stream}, TOK, LIM)
    parsed.reasoning = "qwen3"
    return RequestTracker(parsed, TOK, 0.0)


def test_chat_answer_and_stream_split_reasoning() -> None:
    tr = _chat(False)
    tr.consume(TokenOut(rid=tr.rid, new_token_ids=TOK.encode(REPLY), finished=True, finish_reason="stop"))
    msg = openai_body(tr)["choices"][0]["message"]
    assert msg["reasoning_content"] == "I reason" and msg["content"] == "Final."
    tr, deltas = _chat(True), []
    for i, c in enumerate(REPLY):  # one token per character: the tags arrive split
        last = i == len(REPLY) - 1
        out = TokenOut(rid=tr.rid, new_token_ids=[ord(c)], finished=last, finish_reason="stop" if last else None)
        for e in stream_chunks(tr, tr.consume(out), i == 0):
            deltas.append(json.loads(e.removeprefix(b"data: "))["choices"][0]["delta"])
    assert all(not ("reasoning_content" in d and "content" in d) for d in deltas)  # separate deltas
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I reason"
    assert "".join(d.get("content", "") for d in deltas) == "Final."


def _gen(**body) -> Exception:  # noqa: ANN003
    with pytest.raises(RequestError) as e:
        parse_generate({"sampling_params": {"max_new_tokens": 4}, **body}, TOK, LIM)
    assert e.value.status == 400
    return e.value


def test_generate_extras_bad_inputs_name_the_field() -> None:
    rows = [[0.1, 0.2, 0.3, 0.4]] * 3
    assert "hidden size is 4" in _gen(input_embeds=[[0.1, 0.2]]).message
    assert "'input_embeds'" in _gen(input_embeds=rows, text="hi").message
    assert "'input_embeds'" in _gen(input_embeds="x").message
    assert "'input_embeds'" in _gen(input_embeds=[[0.1, 0.2, "a", 0.4]]).message
    assert "'token_ids_logprob'" in _gen(input_ids=[1, 2], return_logprob=True, token_ids_logprob=[5, 1000]).message
    assert "needs 'return_logprob'" in _gen(input_ids=[1, 2], token_ids_logprob=[5]).message
    assert "'return_hidden_states'" in _gen(input_ids=[1], return_hidden_states=1).message
    assert "'logprob_start_len'" in _gen(input_embeds=rows, return_logprob=True, logprob_start_len=0).message
    ok = parse_generate({"input_embeds": rows, "return_hidden_states": True, "sampling_params": {}}, TOK, LIM)
    assert ok.req.input_ids == [0, 0, 0] and len(ok.req.extras.input_embeds) == 3 * 4 * 4
    assert ok.req.extras.hidden_states
    assert "one choice" in _gen(input_ids=[1], return_hidden_states=True, sampling_params={"n": 2}).message


def test_hidden_states_over_the_limit_are_refused() -> None:
    big = Limits(role="colocated", context_length=100000, vocab_size=1000, model_name="m", hidden_size=4096)
    with pytest.raises(RequestError, match="'return_hidden_states'"):
        parse_generate({"input_ids": [1] * 600, "return_hidden_states": True}, TOK, big)


def test_embeddings_bodies_name_the_field() -> None:
    job = parse_embeddings({"input": ["ab", [1, 2, 3]], "dimensions": 2}, TOK, 1000, 200, 4)
    assert job.inputs == [[97, 98], [1, 2, 3]] and job.dimensions == 2 and not job.base64
    assert parse_embeddings({"input": [5, 6]}, TOK, 1000, 200, 4).inputs == [[5, 6]]
    for body, field in (({"input": []}, "'input'"), ({"input": ""}, "'input[0]'"), ({}, "'input'"),
                        ({"input": "a", "dimensions": 5}, "'dimensions'"), ({"input": [[1, 2000]]}, "'input[0]'"),
                        ({"input": "a", "encoding_format": "hex"}, "'encoding_format'"),
                        ({"input": [["a"]]}, "'input[0]'"), ({"input": "x" * 300}, "'input[0]'")):
        with pytest.raises(EmbedError, match=field.replace("[", r"\[")):
            parse_embeddings(body, TOK, 1000, 200, 4)
