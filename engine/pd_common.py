"""Pieces the prefill and decode workers share: the transfer manager of a worker, the KV
compatibility record, bootstrap-field checks and the worker-side transfer metrics.

Services never import each other; both import this.
"""

from __future__ import annotations

from itertools import accumulate

from engine import messages as m
from engine.config import ServerConfig
from engine.metrics import Histogram
from engine.model_runner import ModelRunner
from engine.request import Req
from engine.scheduler import validate_prompt
from engine.worker import error_out, req_from_msg
from transfer import CompatInfo, TransferConfig, TransferError, TransferManager

KV_LAYOUT = "page_major:[pages,layers,2,page_size,kv_heads,head_dim]"
TRANSFER_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def compat_info(runner: ModelRunner) -> CompatInfo:
    mc = runner.model_cfg
    return CompatInfo(model=mc.model_type + f":{mc.num_layers}x{mc.hidden_size}:{mc.vocab_size}",
                      dtype=runner.cfg.dtype, page_size=runner.page_size, kv_layout=KV_LAYOUT,
                      num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim)


def make_transfer_manager(cfg: ServerConfig, runner: ModelRunner, role: str) -> TransferManager:
    pd = cfg.pd
    tc = TransferConfig(
        role=role, advertise_host=pd.advertise_host or "127.0.0.1", bootstrap_port=pd.bootstrap_port,
        backend=pd.transfer_backend, bootstrap_timeout_s=pd.bootstrap_timeout_s,
        waiting_timeout_s=pd.waiting_timeout_s, heartbeat_interval_s=pd.heartbeat_interval_s,
        cluster_token=pd.cluster_token,
    )
    return TransferManager(tc, runner.pool.buffer, compat_info(runner))


def bootstrap_error(req: Req, role: str) -> str | None:
    """A message when the request lacks what a PD worker needs to find its peer."""
    if req.bootstrap_room is None or not 0 <= req.bootstrap_room < 2**63:
        return f"{role} requests need bootstrap_room, an integer in [0, 2^63)"
    if role == "decode":
        if not req.bootstrap_host:
            return "decode requests need bootstrap_host (the prefill's advertised address)"
        if req.bootstrap_port is None or not 0 < req.bootstrap_port < 65536:
            return "decode requests need bootstrap_port in 1..65535"
    return None


def parse_pd_request(msg: m.GenerateReq, role: str, runner: ModelRunner) -> tuple[Req | None, m.TokenOut | None]:
    """(the request, None), or (None, the 400 that answers it): bad sampling parameters, missing or
    invalid bootstrap fields, an empty prompt or one the context or the KV pool cannot hold."""
    try:
        req = req_from_msg(msg)
    except ValueError as e:
        return None, error_out(msg.rid, str(e), 400)
    err = bootstrap_error(req, role) or validate_prompt(
        req, runner.context_length, runner.pool.allocator.capacity, runner.page_size)
    return (None, error_out(msg.rid, err, 400)) if err else (req, None)


def transfer_error(err: TransferError | None, role: str) -> tuple[str, int, str]:
    """(message, status, fault) of a failed room on a `role` worker; fault names the peer role when
    the peer caused the failure (the router blames that worker), else ""."""
    if err is None:
        return "KV transfer failed", 500, ""
    fault = ("decode" if role == "prefill" else "prefill") if err.peer_fault else ""
    return f"KV transfer failed: {err.message}", int(err.code), fault


class TransferStats:
    """Bytes, rooms and latency of this worker's KV transfers, shaped for StatsOut.info."""

    def __init__(self) -> None:
        self.bytes = 0
        self.succeeded = 0
        self.failed = 0
        self.seconds = Histogram("transfer_seconds", "room ready to transfer done", TRANSFER_BUCKETS)

    def success(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.succeeded += 1
        self.seconds.observe(seconds)

    def info(self) -> dict:
        h = self.seconds
        return {
            "transfer_bytes_total": self.bytes,
            "transfer_rooms": {"succeeded": self.succeeded, "failed": self.failed},
            "histograms": {"transfer_seconds": {"le": list(h.buckets), "counts": list(accumulate(h.counts[:-1])),
                                                "sum": h.sum, "count": h.count}},
        }
