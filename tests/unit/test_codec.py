"""common.codec: one codec, one strictness, for the service and the transfer messages alike."""

from __future__ import annotations

import msgpack
import pytest

from engine.request_groups import Bootstrap, Extras, LogprobParams, ReqOptions
from engine.sampling.params import SamplingParams
from service import messages as sm
from service.stats import Counters, WorkerStats
from transfer import messages as tm


def test_service_messages_round_trip_typed() -> None:
    req = sm.GenerateReq(rid="r", input_ids=[1, 2], sampling=SamplingParams(stop=("x",), max_new_tokens=3),
                         pd=Bootstrap("h", 1, 5), logprobs=LogprobParams(True, 2, 0),
                         options=ReqOptions(priority=3, extra_key="k"), extras=Extras(True, b"\0\0\0\0", [4]))
    assert sm.decode(sm.encode(req)) == req  # the groups travel as typed maps inside the message
    batch = sm.TokenBatch(outs=[sm.TokenOut(rid="r", new_token_ids=[7], finished=True, finish_reason="stop")])
    assert sm.decode(sm.encode(batch)) == batch
    stats = sm.StatsOut(token=3, info={"model_path": "/m", "type": "not a message"},
                        stats=WorkerStats(queues={"waiting": 1}, counters=Counters(retractions=2)))
    assert sm.decode(sm.encode(stats)) == stats


@pytest.mark.parametrize("codec", [sm, tm])
def test_one_strictness(codec) -> None:  # noqa: ANN001
    ok = sm.AbortReq(rid="r") if codec is sm else tm.AbortAck(room=1)
    wire = msgpack.unpackb(codec.encode(ok))
    for bad in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"x": 1}),
                msgpack.packb({**wire, "type": "Nope"}), msgpack.packb({**wire, "version": 99}),
                msgpack.packb({k: v for k, v in wire.items() if k != "version"})):
        with pytest.raises(ValueError):
            codec.decode(bad)
    assert codec.decode(msgpack.packb({**wire, "newer_optional_field": 1})) == ok
    with pytest.raises(ValueError):
        codec.encode(object())


def test_bad_fields_raise_value_error() -> None:
    wire = msgpack.unpackb(sm.encode(sm.GenerateReq(rid="r", input_ids=[1], sampling=SamplingParams())))
    for sampling in ({"temperature": -1}, {"bogus": 1}, [1]):
        with pytest.raises(ValueError, match="sampling"):
            sm.decode(msgpack.packb({**wire, "sampling": sampling}))
    with pytest.raises(ValueError):
        tm.decode(msgpack.packb({"type": "AbortAck", "version": tm.VERSION}))  # room missing
    with pytest.raises(ValueError):
        sm.encode(tm.AbortAck(room=1))  # a transfer message is not a service message
