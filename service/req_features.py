"""/generate's model extras (issue 40; SGLang's field names, engine/extras/features.py computes them):

  return_hidden_states  true: `meta_info.hidden_states` = [the prompt's [T][H], then one [H] per
                        output token after the first] (SGLang's shape), the last layer after the
                        final norm; streamed, they come with the last event only
  input_embeds          [T][H] numbers instead of `text`/`input_ids` (H = the model's hidden size);
                        the prompt's ids are placeholders, so no prefix is ever shared with it
  token_ids_logprob     ids whose logprobs are reported at every output step
                        (`meta_info.output_token_ids_logprobs`, per token a list of
                        [logprob, id, null]) and, with prompt logprobs asked (logprob_start_len),
                        at each prompt position (`input_token_ids_logprobs`, position 0 null); needs
                        `return_logprob`

Every bad value is a RequestError (400) naming the field. In PD the prefill's prompt states and
values travel to the decode in the room's metadata; `MAX_HIDDEN_FLOATS` bounds what one request's
hidden states may hold (on every role).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from common.checks import is_int
from engine.extras.features import PLACEHOLDER_ID
from engine.request_groups import Extras
from service.messages import TokenOut
from service.parsed import Limits, ParsedRequest, RequestError

MAX_HIDDEN_FLOATS = 1 << 21  # (prompt + max new tokens) x hidden size, per request
MAX_TOKEN_IDS = 64  # token_ids_logprob entries


def _error(message: str) -> Exception:
    return RequestError(message)


def input_embeds(body: dict[str, Any], limits: Limits) -> tuple[list[int], bytes] | None:
    """(placeholder prompt ids, float32 bytes [T, H]) of a body with `input_embeds`, else None."""
    raw = body.get("input_embeds")
    if raw is None:
        return None
    if body.get("text") is not None or body.get("input_ids") is not None:
        raise _error("'input_embeds' replaces 'text' and 'input_ids': give only one of the three")
    h = limits.hidden_size
    if not isinstance(raw, list) or not raw or not all(isinstance(row, list) for row in raw):
        raise _error(f"'input_embeds' must be a non-empty list of rows of {h} numbers (one per position)")
    bad = next((i for i, row in enumerate(raw) if len(row) != h), None)
    if bad is not None:
        raise _error(f"'input_embeds[{bad}]' has {len(raw[bad])} values; this model's hidden size is {h}")
    try:
        t = torch.tensor(raw, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError):
        raise _error("'input_embeds' must hold numbers only") from None
    if not bool(torch.isfinite(t).all()):
        raise _error("'input_embeds' holds a value that is not a finite number")
    return [PLACEHOLDER_ID] * len(raw), t.numpy().tobytes()


def _token_ids(body: dict[str, Any], limits: Limits) -> list[int]:
    ids = body.get("token_ids_logprob")
    if ids is None:
        return []
    if not isinstance(ids, list) or not ids or len(ids) > MAX_TOKEN_IDS or not all(is_int(t) for t in ids):
        raise _error(f"'token_ids_logprob' must be a list of 1..{MAX_TOKEN_IDS} integer token ids")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise _error(f"'token_ids_logprob' holds token id {bad[0]} outside the vocabulary [0, {limits.vocab_size})")
    if not body.get("return_logprob"):
        raise _error("'token_ids_logprob' needs 'return_logprob': true")
    return ids


def apply(parsed: ParsedRequest, body: dict[str, Any], embeds: tuple[list[int], bytes] | None,
          limits: Limits) -> None:
    """Check the extras of a parsed /generate body and put them on its GenerateReq (its extras group)."""
    hidden = body.get("return_hidden_states")
    if hidden is not None and not isinstance(hidden, bool):
        raise _error("'return_hidden_states' must be true or false")
    ids = _token_ids(body, limits)
    req = parsed.req
    if not (hidden or embeds or ids):
        return
    if req.n > 1:
        raise _error("'return_hidden_states', 'input_embeds' and 'token_ids_logprob' take one choice ('n' 1)")
    if embeds and req.logprobs.start_len >= 0:
        raise _error("'logprob_start_len' reports prompt tokens; an 'input_embeds' prompt has none")
    floats = (len(req.input_ids) + req.sampling.max_new_tokens) * limits.hidden_size
    if hidden and floats > MAX_HIDDEN_FLOATS:
        raise _error(f"'return_hidden_states': {len(req.input_ids)} prompt + {req.sampling.max_new_tokens} new "
                     f"tokens of {limits.hidden_size} values exceed the limit of {MAX_HIDDEN_FLOATS} values")
    parsed.req = dataclasses.replace(req, extras=Extras(bool(hidden), embeds[1] if embeds else b"", ids))


class FeatureLog:
    """The frontend's record of one request's extras (RequestTracker feeds it every TokenOut)."""

    def __init__(self) -> None:
        self.hidden_prompt: list[list[float]] = []
        self.hidden_output: list[list[float]] = []
        self.ids_output: list[list[float]] = []
        self.ids_input: list[list[float]] = []

    def consume(self, out: TokenOut) -> None:
        if out.hidden_prompt:
            self.hidden_prompt = out.hidden_prompt
        self.hidden_output += out.hidden_output
        self.ids_output += out.ids_output
        if out.ids_input:
            self.ids_input = out.ids_input

    def meta(self, parsed: ParsedRequest, finished: bool) -> dict[str, Any]:
        """SGLang's meta_info keys for what the request asked (hidden states once finished)."""
        asked, start, meta = parsed.req.extras, parsed.req.logprobs.start_len, {}
        if asked.hidden_states and finished and parsed.role != "prefill":
            meta["hidden_states"] = [self.hidden_prompt, *self.hidden_output] if self.hidden_prompt else []
        if asked.token_ids_logprob and parsed.role != "prefill":
            ids = asked.token_ids_logprob
            meta["output_token_ids_logprobs"] = [_triples(v, ids) for v in self.ids_output]
            if start >= 0:
                first = [None] if start == 0 else []
                meta["input_token_ids_logprobs"] = first + [_triples(v, ids) for v in self.ids_input]
        return meta


def _triples(values: list[float], ids: list[int]) -> list[list[Any]]:
    return [[v, t, None] for v, t in zip(values, ids)]
