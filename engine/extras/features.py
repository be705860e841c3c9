"""Per-request model extras (SGLang's `return_hidden_states`, `input_embeds`, `token_ids_logprob`):
what a request asked for, what the engine computed for it, and the hooks the forward and the
batch executor call. Nothing here runs for a request that asked for none of them.

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
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.forward.model_runner import Segment

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


# ---- forward hooks (engine.forward.model_runner) --------------------------------------------------------
@torch.inference_mode()
def batch_embeds(segments: list[Segment], embed: torch.nn.Module, ids: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor | None:
    """The input rows [T, H] of a batch where some segment carries input embeddings (None when none
    does: the model looks its ids up itself)."""
    if all(s.embeds is None for s in segments):
        return None
    x = embed(ids)
    off = 0
    for s in segments:
        n = len(s.tokens)
        if s.embeds is not None:  # a resumed prompt's output ids follow its embeddings: rows < n
            x[off : off + s.embeds.shape[0]] = s.embeds.to(device=x.device, dtype=dtype)
        off += n
    return x


def capture_hidden(segments: list[Segment], hidden: torch.Tensor) -> None:
    """Give each segment that asked (`Segment.hidden`) its rows of the final hidden states, fp32 on the
    CPU (`Segment.hidden_out` [n, H])."""
    off = 0
    for s in segments:
        n = len(s.tokens)
        if s.hidden:
            s.hidden_out = hidden[off : off + n].float().cpu()
        off += n


# ---- batch hooks (engine.forward.batch) ------------------------------------------------------------------
def prepare(seg: Segment, f: Features, start: int, prompt: bool) -> None:
    """Ask the segment of a request's tokens [start, start + n) for what the request needs."""
    if not f.active:
        return
    seg.hidden = f.hidden
    if prompt and f.embeds is not None and start < f.embeds.shape[0]:
        seg.embeds = f.embeds[start : start + len(seg.tokens)]


def collect(seg: Segment, f: Features, prompt: bool) -> None:
    """Keep the hidden states a segment computed: prompt rows, or the decode step's one row."""
    if seg.hidden_out is None:
        return
    rows = seg.hidden_out.tolist()
    if prompt:
        f.hidden_prompt.extend(rows)
    else:
        f.hidden_output.append(rows[-1])
    seg.hidden_out = None


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
