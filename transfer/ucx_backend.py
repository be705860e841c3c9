"""UCX data plane through ucxx's low-level API (`ucxx._lib.libucxx`), progressed explicitly.

One UCX context + worker per TransferManager, in blocking progress mode: `progress()` drives it from
the worker loop, `wait_fd()` arms its epoll fd so an idle loop can sleep on it next to the zmq
sockets. Peers are reached by worker address (`UCXEndpoint.create_from_worker_address`) with
endpoint error handling off, which lets UCX pick shared memory on one host and TCP across hosts.

UCX settings: TCP segment sizes default to 1 MiB here (2-3x faster than UCX's 8 KiB default on
loopback) unless UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE are set; everything else comes from
UCX's own UCX_* environment (tests set UCX_TLS=tcp to force TCP). UCX_WARN_UNUSED_ENV_VARS=n is
set if unset, or UCX prints warnings on stdout.

Buffers: CPU tensors go in as numpy views (zero copy; ucxx refuses CPU torch tensors), CUDA
tensors as themselves (__cuda_array_interface__), so GPU pages move without host staging.
"""

from __future__ import annotations

import logging
import os

import torch

from transfer.backend import SLOT_SHIFT, Handle, Probe

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx._lib.libucxx as ucx_api  # noqa: E402
from ucxx._lib.arr import Array  # noqa: E402

log = logging.getLogger(__name__)
_SLOT_MASK = ((1 << 64) - 1) ^ ((1 << SLOT_SHIFT) - 1)


def _ucx_options() -> dict[str, str]:
    opts = {}
    for key in ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"):
        if f"UCX_{key}" not in os.environ:
            opts[key] = "1M"
    return opts


def _array(buf: torch.Tensor) -> Array:
    # buf: uint8, contiguous, CPU or CUDA
    if not buf.is_contiguous():
        raise ValueError("UCX buffers must be contiguous")
    return Array(buf if buf.is_cuda else buf.numpy())


class _UcxHandle:
    def __init__(self, req: ucx_api.UCXRequest, keep: object) -> None:
        self._req = req
        self._keep = keep  # the buffer must outlive the request
        self._error: str | None = None
        self._done = False

    def _check(self) -> None:
        if self._done or not self._req.completed:
            return
        self._done = True
        try:
            self._req.check_error()
        except ucx_api.UCXError as e:  # ucxx's errors (connection reset, canceled, truncated)
            self._error = f"{type(e).__name__}: {e}"
        self._keep = None

    @property
    def done(self) -> bool:
        self._check()
        return self._done

    @property
    def error(self) -> str | None:
        self._check()
        return self._error


class UcxBackend:
    def __init__(self) -> None:
        self._ctx = ucx_api.UCXContext(config_dict=_ucx_options(),
                                       feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self._worker = ucx_api.UCXWorker(self._ctx)
        self._worker.init_blocking_progress_mode()
        self.address: bytes = self._worker.address.tobytes()
        self._eps: dict[bytes, ucx_api.UCXEndpoint] = {}
        self._sinks: list[_UcxHandle] = []  # receives of discarded late messages

    def _endpoint(self, peer: bytes) -> ucx_api.UCXEndpoint:
        ep = self._eps.get(peer)
        if ep is None:
            addr = ucx_api.UCXAddress.create_from_buffer(peer)
            ep = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, addr, False)
            self._eps[peer] = ep
        return ep

    def send(self, peer: bytes, tag: int, buf: torch.Tensor) -> Handle:
        arr = _array(buf)
        return _UcxHandle(self._endpoint(peer).tag_send(arr, ucx_api.UCXXTag(tag)), (arr, buf))

    def probe(self, tag: int, nbytes: int) -> Probe | None:
        res = self._worker.tag_probe(ucx_api.UCXXTag(tag), remove=True)
        if not res.matched:
            return None
        return Probe(tag, res.length, res)

    def recv(self, probe: Probe, buf: torch.Tensor) -> Handle:
        arr = _array(buf)
        return _UcxHandle(self._worker.tag_recv_with_handle(arr, probe.raw), (arr, buf))

    def drop_slot(self, slot: int) -> int:
        dropped = 0
        while True:
            res = self._worker.tag_probe(ucx_api.UCXXTag(slot << SLOT_SHIFT),
                                         ucx_api.UCXXTagMask(_SLOT_MASK), remove=True)
            if not res.matched:
                return dropped
            sink = torch.empty(res.length, dtype=torch.uint8)  # [length] bytes, discarded
            self._sinks.append(_UcxHandle(self._worker.tag_recv_with_handle(_array(sink), res), sink))
            dropped += 1

    def disconnect(self, peer: bytes) -> None:
        ep = self._eps.pop(peer, None)
        if ep is not None:
            ep.close()  # cancels its in-flight sends

    def progress(self) -> None:
        self._worker.progress()
        if self._sinks:
            self._sinks = [h for h in self._sinks if not h.done]

    @property
    def pending_sinks(self) -> int:
        return len(self._sinks)

    def wait_fd(self) -> tuple[bool, int | None]:
        self._worker.progress()
        if not self._worker.arm():  # events pending: do not sleep
            return False, None
        return True, self._worker.epoll_file_descriptor

    def close(self) -> None:
        for peer in list(self._eps):
            self.disconnect(peer)
        self._worker.progress()
