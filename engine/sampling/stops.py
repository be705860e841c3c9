"""Stop conditions: whether the last token a request got ends it (StopChecker).

`TailDecoder` is the one text decoder stop strings are checked with (every scheduler builds its
StopChecker with one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.request import FinishReason, Req


class TailDecoder:
    """Output ids -> text for stop strings, with the model's own tokenizer (loaded on first use, so a
    worker whose requests carry no stop strings never loads it)."""

    def __init__(self, model_path: str | Path) -> None:
        self.model_path = str(model_path)
        self._tok: Any = None

    def __call__(self, ids: list[int]) -> str:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model_path)
        return self._tok.decode(ids, skip_special_tokens=False)


class StopChecker:
    """Decides whether the last appended token ends a request."""

    def __init__(self, eos_ids: tuple[int, ...], context_length: int, decode_tail=None) -> None:  # noqa: ANN001
        self.eos_ids = set(eos_ids)
        self.context_length = context_length
        self.decode_tail = decode_tail  # callable(list[int]) -> str, for stop strings

    def check(self, req: Req) -> None:
        sp = req.sampling
        tok = req.token_ids[-1]
        if tok in sp.stop_token_ids:
            req.matched_stop = tok
            req.finish(FinishReason.STOP)
            return
        if not sp.ignore_eos and tok in self.eos_ids:
            req.matched_stop = tok
            req.finish(FinishReason.STOP)
            return
        if req.grammar is not None and req.grammar.is_terminated():  # the grammar's value is complete
            req.finish(FinishReason.STOP)
            return
        if sp.stop and self.decode_tail is not None:
            longest = max(len(s) for s in sp.stop)
            ids = req.token_ids
            tail = self.decode_tail(ids[max(req.num_prompt_tokens, len(ids) - longest - 8):])
            for s in sp.stop:
                if s in tail:
                    req.matched_stop = s
                    req.finish(FinishReason.STOP)
                    return
        if req.num_output_tokens >= sp.max_new_tokens:
            req.finish(FinishReason.LENGTH)
        elif len(req.token_ids) >= self.context_length:
            req.finish(FinishReason.LENGTH)
