"""The forward batch: every input of one model step, built once from the scheduled segments.

    segments (what the scheduler chose: a request's new tokens each)
      -> build_batch(segments, page_size)   pure Python: ids, positions, KV slots, page tables,
                                            logits rows; each segment's extras add their inputs
      -> runner.forward(batch)              ModelRunner (engine/forward/model_runner.py), or rank 0's
                                            TPRunner (engine/distributed/tp_runner.py), same call
      -> ForwardOutput                      logits per segment, captured hidden states

A segment carries only what every request has (pages, start, tokens, which rows get logits) plus
`extras`: what per-request extras add to the batch, each defined in its own module (input embeddings
and hidden-state capture: engine/extras/features.py; a LoRA adapter: engine/extras/lora/batch.py).
An extra implements `BatchExtra.add`, filling the batch's typed fields for its rows; a batch without
extras leaves them None and the model runs exactly as without the feature.

`forward_segments(runner, segments)` is the prepare-and-run of callers that hold segments: a batch
naming more than `--max-loras-per-batch` adapters runs as several forwards of at most that many each
(segments are independent: each writes only its own KV positions); results keep the segments' order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

LOGITS_NONE, LOGITS_LAST, LOGITS_ALL = 0, 1, 2


class BatchExtra(Protocol):
    """One request extra's input to a segment's forward (engine/extras/)."""

    def add(self, batch: ForwardBatch, seg: int, row: int) -> None:
        """Fill `batch`'s fields for segment `seg`, whose tokens are rows row .. row + n - 1 of the
        batch (called once the batch holds every segment's tokens)."""


@dataclass(slots=True)
class Segment:
    pages: list[int]  # the request's pages (covering start + len(tokens))
    start: int  # cache position of the first new token
    tokens: list[int]  # new tokens
    logits: int = LOGITS_LAST
    skip: int = 0  # LOGITS_ALL: the first `skip` rows get no logits
    extras: tuple[BatchExtra, ...] = ()  # what per-request extras add to the batch (engine/extras/)
    slot: int = -1  # the request's recurrent-state slot (hybrid models: engine/recurrent/state_pool.py); -1: none


@dataclass(slots=True)
class ForwardBatch:
    """Every input of one forward; T = the segments' tokens, B = the segments."""

    segments: list[Segment]  # what it was built from (TP: ranks > 0 build the same batch from these)
    ids: list[int]  # [T] token ids, the segments' tokens concatenated
    positions: list[int]  # [T] cache position of each token
    out_page: list[int]  # [T] the page receiving each token's KV
    out_offset: list[int]  # [T] its slot in that page
    page_table: list[list[int]]  # [B] each segment's pages
    seq_lens: list[int]  # [B] tokens cached once this forward has run
    new_lens: list[int]  # [B] new tokens
    logit_rows: list[int]  # rows of the final hidden states the LM head reads, in order
    picks: list[int | slice | None]  # [B] each segment's logits among them: a row, rows, or none
    state_slots: list[int] | None = None  # [B] each segment's recurrent-state slot (None: no segment has one)
    # [B] a speculative verify's slots taking the state after each of its positions but the last (() for the
    # other segments; None: no segment has them; engine/extras/speculative/states.py)
    state_checkpoints: list[tuple[int, ...]] | None = None
    # extras' inputs (None: no segment has one)
    adapters: list[str] | None = None  # [B] LoRA adapter of each segment ("" = the base model)
    embeds: list[tuple[int, torch.Tensor]] | None = None  # (first row, float32 [n, H]) replacing the ids' embeddings
    deepstack: list[tuple[int, torch.Tensor]] | None = None  # (first row, [k, n, H]) added after decoder layers 0..k-1
    rope3: list[tuple[int, torch.Tensor]] | None = None  # (first row, int64 [3, n]) M-RoPE positions; other rows:
    # their cache position on all three axes (engine.extras.multimodal)
    capture: list[tuple[int, int, int]] | None = None  # (segment, first row, n): final hidden states to return


class ForwardOutput(NamedTuple):
    logits: list[torch.Tensor | None]  # [B]: fp32 [V] (LOGITS_LAST), [n - skip, V] (LOGITS_ALL) or None
    hidden: list[torch.Tensor | None] | None  # [B]: fp32 [n, H] on the CPU where `capture` asked; None: none did


class Runner(Protocol):
    """What runs a ForwardBatch: a ModelRunner, or rank 0's TPRunner over a group of them."""

    cfg: Any  # engine.config.EngineConfig

    @property
    def page_size(self) -> int: ...

    def forward(self, batch: ForwardBatch) -> ForwardOutput: ...


def build_batch(segments: list[Segment], page_size: int) -> ForwardBatch:
    """The batch of `segments` (pure: lists only, no tensors built; the runner makes them)."""
    ps = page_size
    ids: list[int] = []
    pos: list[int] = []
    out_page: list[int] = []
    out_off: list[int] = []
    rows: list[int] = []
    picks: list[int | slice | None] = []
    extended: list[tuple[int, int]] = []  # (segment, first row) of segments with extras
    off = 0
    for i, s in enumerate(segments):
        n = len(s.tokens)
        ids.extend(s.tokens)
        rng = range(s.start, s.start + n)
        pos.extend(rng)
        out_page.extend(s.pages[p // ps] for p in rng)
        out_off.extend(p % ps for p in rng)
        if s.logits == LOGITS_LAST:
            picks.append(len(rows))
            rows.append(off + n - 1)
        elif s.logits == LOGITS_ALL:
            picks.append(slice(len(rows), len(rows) + n - s.skip))
            rows.extend(range(off + s.skip, off + n))
        else:
            picks.append(None)
        if s.extras:
            extended.append((i, off))
        off += n
    batch = ForwardBatch(segments, ids, pos, out_page, out_off, [s.pages for s in segments],
                         [s.start + len(s.tokens) for s in segments], [len(s.tokens) for s in segments],
                         rows, picks)
    if segments and segments[0].slot >= 0:
        batch.state_slots = [s.slot for s in segments]
    for i, row in extended:
        for extra in segments[i].extras:
            extra.add(batch, i, row)
    return batch


def split_by_adapters(names: list[str], cap: int) -> list[list[int]]:
    """Indices of segments running under adapters `names` ("" = base) in groups naming at most `cap`
    distinct adapters each (one group when they fit)."""
    if len(set(names) - {""}) <= cap:
        return [list(range(len(names)))]
    groups: list[list[int]] = [[]]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name and name not in seen and len(seen) >= cap:
            groups.append([])
            seen = set()
        if name:
            seen.add(name)
        groups[-1].append(i)
    return groups


def forward_segments(runner: Runner, segments: list[Segment]) -> ForwardOutput:
    """Build the segments' batch and run it; over --max-loras-per-batch adapters, as several forwards."""
    batch = build_batch(segments, runner.page_size)
    if batch.adapters is None:
        return runner.forward(batch)
    groups = split_by_adapters(batch.adapters, runner.cfg.max_loras_per_batch)
    if len(groups) == 1:
        return runner.forward(batch)
    logits: list[torch.Tensor | None] = [None] * len(segments)
    hidden: list[torch.Tensor | None] = [None] * len(segments)
    captured = False
    for g in groups:
        out = runner.forward(build_batch([segments[i] for i in g], runner.page_size))
        for j, i in enumerate(g):
            logits[i] = out.logits[j]
            if out.hidden is not None:
                hidden[i], captured = out.hidden[j], True
    return ForwardOutput(logits, hidden if captured else None)
