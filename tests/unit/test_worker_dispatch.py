"""The worker loop's message table (service/worker.py: Dispatch): each frontend message goes to the
Role call that takes it; control messages are answered at once, requests report through the step."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.sampling.params import SamplingParams
from service import messages as m
from service.config import ServerConfig
from service.stats import WorkerStats
from service.worker import Dispatch


class _Role:
    """A stand-in Role that records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.kv = None

    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]:
        self.calls.append(("add", msg.rid))
        return [m.TokenOut(rid=msg.rid, new_token_ids=[])]

    def abort(self, msg: m.AbortReq) -> None:
        self.calls.append(("abort", msg.rid))

    def close_session(self, session_id: str) -> None:
        self.calls.append(("close_session", session_id))

    def stats(self) -> WorkerStats:
        return WorkerStats(queues={"waiting": 3})


def test_each_message_goes_to_its_role_call_and_control_is_answered_at_once() -> None:
    role, replies = _Role(), []
    dispatch = Dispatch(ServerConfig(role="colocated", engine=EngineConfig()), role, {"role": "colocated"},
                        replies.append)  # type: ignore[arg-type]
    gen = m.GenerateReq(rid="a", input_ids=[1, 2], sampling=SamplingParams())
    outs = dispatch([gen, m.AbortReq(rid="b"), m.CloseSessionReq("s"), m.StatsReq(token=7), "not a message"])
    assert [o.rid for o in outs] == ["a"]  # only the request's report joins the step's TokenBatch
    assert role.calls == [("add", "a"), ("abort", "b"), ("close_session", "s")]
    assert len(replies) == 1 and isinstance(replies[0], m.StatsOut)
    assert replies[0].token == 7 and replies[0].stats.queues == {"waiting": 3} and replies[0].stats.time > 0
