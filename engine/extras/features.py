"""Per-request model extras (SGLang's `return_hidden_states`, `input_embeds`, `token_ids_logprob`):
what a request asked for, what it adds to the forward batch (`prepare`: `InputEmbeds`,
`CaptureHidden`, as Segment.extras), and the hooks the batch executor calls after the forward.
Nothing here runs for a request that asked for none of them.

Hidden states are the last layer's, after the final norm (the rows the LM head reads): SGLang's
`meta_info.hidden_states`, and transformers' `output_hidden_states[-1]`. Shape as SGLang reports
them: the prompt's positions once ([T, H], computed by the extend chunks), then one [H] per decode
step (the state of the position whose token was fed in: output token i > 0 was sampled from it).

Input embeddings replace the embedding lookup of the prompt's positions ([T, H] float32); the
prompt's ids are placeholders (PLACEHOLDER_ID), so such a request gets a cache namespace of its own
(`namespace`): no other request ever matches its pages, nor does it match theirs, on any role.

token_ids_logprob: the logprob (log_softmax of the raw logits, as engine.sampling.logprobs) of each chosen
id at each output step and, with prompt logprobs asked, at each prompt position reported.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

PLACEHOLDER_ID = 0  # the prompt ids of an input_embeds request (never read by the model)


@dataclass
class Features:
    """What one request asked for beyond tokens, and what was computed for it."""

    hidden: bool = False  # return_hidden_states
    embeds: torch.Tensor | None = None  # float32 [T, H]: the prompt's input embeddings
    ids: list[int] = field(default_factory=list)  # token_ids_logprob
    namespace: str = ""  # a prefix-cache namespace of its own (input_embeds), "" = the request's usual
    hidden_prompt: list[list[float]] = field(default_factory=list)  # [T][H], filled chunk by chunk
    hidden_output: list[list[float]] = field(default_factory=list)  # one [H] per decode step
    ids_input: list[list[float]] = field(default_factory=list)  # per prompt position reported
    ids_output: list[list[float]] = field(default_factory=list)  # per output token
    sent_hidden: int = -1  # report cursor of hidden_output (-1: the prompt's not yet sent)
    sent_ids: int = 0  # report cursor of ids_output
    ids_input_sent: bool = False

    @property
    def active(self) -> bool:
        return self.hidden or self.embeds is not None or bool(self.ids)


def make_features(hidden: bool = False, embeds: bytes = b"", rows: int = 0,
                  ids: list[int] | None = None) -> Features:
    """A request's Features from its message fields: `embeds` is float32 bytes of [rows, H]."""
    f = Features(hidden=hidden, ids=list(ids or []))
    if embeds:
        f.embeds = torch.frombuffer(bytearray(embeds), dtype=torch.float32).view(rows, -1)
        f.namespace = f"\x1einput_embeds:{uuid.uuid4().hex}"
    return f


# ---- what a request adds to the forward batch (engine/forward/forward_batch.py: Segment.extras) ------
class _Inputs(Protocol):
    """The ForwardBatch fields these extras fill (engine/forward/forward_batch.py)."""

    new_lens: list[int]
    embeds: list[tuple[int, torch.Tensor]] | None
    capture: list[tuple[int, int, int]] | None


@dataclass(frozen=True, slots=True)
class InputEmbeds:
    """A prompt chunk's input embeddings: they replace the embedding lookup of its first rows."""

    rows: torch.Tensor  # float32 [n, H] (a resumed prompt's output ids follow its embeddings: n <= tokens)

    def add(self, batch: _Inputs, seg: int, row: int) -> None:
        if batch.embeds is None:
            batch.embeds = []
        batch.embeds.append((row, self.rows))


@dataclass(frozen=True, slots=True)
class CaptureHidden:
    """Return the segment's final hidden states (ForwardOutput.hidden: fp32 [n, H] on the CPU)."""

    def add(self, batch: _Inputs, seg: int, row: int) -> None:
        if batch.capture is None:
            batch.capture = []
        batch.capture.append((seg, row, batch.new_lens[seg]))


CAPTURE = CaptureHidden()


def prepare(f: Features, start: int, n: int, prompt: bool) -> tuple[InputEmbeds | CaptureHidden, ...]:
    """What the segment of a request's tokens [start, start + n) adds to the batch (Segment.extras)."""
    if not f.active:
        return ()
    extras: tuple[InputEmbeds | CaptureHidden, ...] = (CAPTURE,) if f.hidden else ()
    if prompt and f.embeds is not None and start < f.embeds.shape[0]:
        extras += (InputEmbeds(f.embeds[start : start + n]),)
    return extras


# ---- after the forward (engine.forward.batch) -----------------------------------------------------------
def collect(hidden: torch.Tensor | None, f: Features, prompt: bool) -> None:
    """Keep the hidden states a segment captured (fp32 [n, H]): prompt rows, or the decode step's one row."""
    if hidden is None:
        return
    rows = hidden.tolist()
    if prompt:
        f.hidden_prompt.extend(rows)
    else:
        f.hidden_output.append(rows[-1])


def ids_logprobs(logits: torch.Tensor, ids: list[int]) -> list[list[float]]:
    """logits fp32 [n, V] -> [n][len(ids)]: log_softmax of each row at each chosen id."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    return lp[:, torch.tensor(ids, dtype=torch.long, device=lp.device)].tolist()


def report(f: Features) -> dict[str, Any]:
    """What to send since the last report (service TokenOut fields), advancing the cursors (a PD
    prefill has moved everything into its room's metadata, `to_meta`: it reports nothing)."""
    out: dict[str, Any] = {}
    if not f.active:
        return out
    if f.hidden:
        if f.sent_hidden < 0 and f.hidden_prompt:
            out["hidden_prompt"] = f.hidden_prompt
            f.sent_hidden = 0
        if f.sent_hidden >= 0 and len(f.hidden_output) > f.sent_hidden:
            out["hidden_output"] = f.hidden_output[f.sent_hidden :]
            f.sent_hidden = len(f.hidden_output)
    if f.ids:
        if len(f.ids_output) > f.sent_ids:
            out["ids_output"] = f.ids_output[f.sent_ids :]
            f.sent_ids = len(f.ids_output)
        if f.ids_input and not f.ids_input_sent:
            out["ids_input"] = f.ids_input
            f.ids_input_sent = True
    return out


# ---- PD: what the prefill's room metadata carries (prefill_service, decode_service) ------------------
def to_meta(f: Features) -> dict[str, Any]:
    """The prompt's hidden states (float32 bytes [T, H]) and token_ids_logprob values (the first
    output token's, the prompt's) for the decode to report: moved out of `f` (the prefill reports
    none of them)."""
    meta: dict[str, Any] = {}
    if f.hidden and f.hidden_prompt:
        meta["hidden_prompt"] = torch.tensor(f.hidden_prompt, dtype=torch.float32).numpy().tobytes()
        meta["hidden_size"] = len(f.hidden_prompt[0])
        f.hidden_prompt = []
    if f.ids and f.ids_output:
        meta["ids_first"], meta["ids_input"] = f.ids_output[0], f.ids_input
        f.ids_output, f.ids_input = [], []
    return meta


def from_meta(f: Features, meta: dict[str, Any]) -> None:
    """The decode's side of `to_meta`."""
    raw, h = meta.get("hidden_prompt"), int(meta.get("hidden_size") or 0)
    if f.hidden and raw and h:
        f.hidden_prompt = torch.frombuffer(bytearray(raw), dtype=torch.float32).view(-1, h).tolist()
    if f.ids and meta.get("ids_first") is not None:
        f.ids_output.append(list(meta["ids_first"]))
        f.ids_input = list(meta.get("ids_input") or [])
