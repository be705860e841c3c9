"""The forward batch (engine/forward/forward_batch.py): built once, in pure Python, from the segments;
each per-request extra fills its own fields; a batch over --max-loras-per-batch adapters runs split,
its results in the segments' order. No model: a stand-in runner records the batches it gets."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.extras.features import CAPTURE, Features, InputEmbeds, prepare
from engine.extras.lora.batch import Adapter
from engine.forward.forward_batch import (
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    ForwardBatch,
    ForwardOutput,
    Segment,
    build_batch,
    forward_segments,
)


def test_tokens_slots_and_logit_rows() -> None:
    segs = [Segment([7, 3], 2, [10, 11, 12], LOGITS_LAST),  # page size 4: positions 2..4 -> pages 7, 7, 3
            Segment([5], 0, [20, 21], LOGITS_NONE),
            Segment([9, 8], 3, [30, 31, 32], LOGITS_ALL, skip=1)]
    b = build_batch(segs, 4)
    assert b.ids == [10, 11, 12, 20, 21, 30, 31, 32]
    assert b.positions == [2, 3, 4, 0, 1, 3, 4, 5]
    assert b.out_page == [7, 7, 3, 5, 5, 9, 8, 8] and b.out_offset == [2, 3, 0, 0, 1, 3, 0, 1]
    assert b.page_table == [[7, 3], [5], [9, 8]] and b.seq_lens == [5, 2, 6] and b.new_lens == [3, 2, 3]
    assert b.logit_rows == [2, 6, 7]  # the first segment's last row; the third's rows after `skip`
    assert b.picks == [0, None, slice(1, 3)]
    assert b.adapters is None and b.embeds is None and b.capture is None  # no extras: the plain model path


def test_extras_fill_their_fields() -> None:
    rows = torch.ones(2, 4)
    segs = [Segment([1], 0, [1, 2], LOGITS_LAST, 0, (Adapter("a"), CAPTURE)),
            Segment([2], 0, [3], LOGITS_LAST),
            Segment([3], 0, [4, 5, 6], LOGITS_LAST, 0, (InputEmbeds(rows),))]
    b = build_batch(segs, 16)
    assert b.adapters == ["a", "", ""]
    assert b.capture == [(0, 0, 2)]
    assert b.embeds is not None and b.embeds[0][0] == 3 and b.embeds[0][1] is rows


def test_features_add_only_what_the_request_asked() -> None:
    assert prepare(Features(), 0, 4, prompt=True) == ()
    f = Features(hidden=True, embeds=torch.zeros(5, 4))
    assert prepare(f, 4, 1, prompt=False) == (CAPTURE,)  # a decode step: no embeddings
    chunk = prepare(f, 3, 4, prompt=True)
    assert chunk[0] is CAPTURE and chunk[1].rows.shape == (2, 4)  # rows 3..4: the prompt's embeddings end there


def test_more_adapters_than_the_cap_run_as_several_forwards_in_order() -> None:
    seen: list[ForwardBatch] = []

    def forward(batch: ForwardBatch) -> ForwardOutput:
        seen.append(batch)
        return ForwardOutput([torch.tensor(float(s.tokens[0])) for s in batch.segments], None)

    runner = SimpleNamespace(cfg=SimpleNamespace(max_loras_per_batch=2), page_size=16, forward=forward)
    names = ["a", "", "b", "c", "a"]
    segs = [Segment([i], 0, [i], LOGITS_LAST, 0, (Adapter(n),) if n else ()) for i, n in enumerate(names)]
    out = forward_segments(runner, segs)  # type: ignore[arg-type]
    assert [float(x) for x in out.logits] == [0, 1, 2, 3, 4] and out.hidden is None  # the segments' order
    assert len(seen) > 1 and all(len(set(b.adapters or []) - {""}) <= 2 for b in seen)
    seen.clear()
    assert len(forward_segments(runner, segs[:3]).logits) == 3 and len(seen) == 1  # two adapters: one forward
