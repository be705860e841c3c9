"""TransferManager: one per worker process; owns the zmq context, the data backend and one side.

The worker loop calls progress() every iteration (never blocks) and idle_wait() when it has
nothing else to do (sleeps on the zmq sockets and the UCX worker's fd, at most until the next
timer). Rooms are created with create_sender (prefill) / create_receiver (decode), polled by the
scheduler, and released after their terminal state was consumed; active_rooms() counts them. A
decode holds a room that waits in its queue for KV memory with hold_room (its prefill keeps the room
waiting meanwhile) and ends one it opened no receiver for with end_room (its prefill ends it too).

Progress during a forward: the worker runs each forward inside `with mgr.background():`. For that
long, and only then, a progress thread owns the transfer state (one lock: the worker thread holds
it at every other moment) and keeps calling progress() and idle_wait(): chunk pages move while the
next chunk computes, acks arrive, heartbeats go out and come in. Leaving the block wakes the thread
(a pipe in its poll set) and takes the lock back, so the worker never shares a room, socket or UCX
call with the thread: the rooms' state machine keeps its single-threaded guarantees (FAILED frees
at once; bytes land only in pages a live room owns). TransferConfig.progress_thread=False (the
`--no-transfer-progress-thread` flag) keeps the old behaviour: nothing moves during a forward.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch
import zmq

from transfer.backend import DataBackend, FakeBackend
from transfer.config import CompatInfo, TransferConfig
from transfer.decode_side import DecodeSide
from transfer.layout import page_view
from transfer.prefill_side import PrefillSide
from transfer.rooms import KVReceiver, KVSender
from transfer.state import ErrorCode, TransferError
from transfer.stats import LinkStats

log = logging.getLogger(__name__)
_TIMER_PERIOD_S = 0.05
_BG_MIN_PASS_S = 0.002  # the progress thread runs at most ~500 busy passes a second


def make_backend(name: str, engine_id: str) -> DataBackend:
    """The data backend called `name` (contract: transfer/backend.py): "fake" or "ucx"."""
    if name == "fake":
        return FakeBackend(engine_id)
    if name == "ucx":
        from transfer.ucx_backend import UcxBackend  # imports ucxx (UCX's libraries) only when used

        return UcxBackend()
    raise ValueError(f"unknown transfer backend {name!r}")


class TransferManager:
    def __init__(self, config: TransferConfig, kv_pool: torch.Tensor, compat: CompatInfo) -> None:
        # kv_pool: [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], contiguous
        self.config = config
        self.engine_id = uuid.uuid4().hex
        self._pool = kv_pool  # keeps the storage of the page view alive
        self._pages = page_view(kv_pool)  # uint8 [num_pages, page_bytes]
        self._zctx = zmq.Context()
        self._backend = make_backend(config.backend, self.engine_id)
        self._side: PrefillSide | DecodeSide
        try:
            side_cls = PrefillSide if config.role == "prefill" else DecodeSide
            self._side = side_cls(config, self._zctx, self.engine_id, self._backend, self._pages, compat)
        except ValueError:
            self._backend.close()
            self._zctx.term()
            raise
        self._next_timers = 0.0
        self._closed = False
        self._lock = threading.Lock()  # who may touch the transfer state: the worker, or the thread
        self._lock.acquire()  # ... the worker, except inside background()
        self._bg_on = threading.Event()  # set while the worker is inside background()
        self._bg_stop = False
        self._bg_passes = 0  # progress passes the thread made (tests and stats)
        self._bg: threading.Thread | None = None
        if config.progress_thread:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)  # a full pipe already holds a wake-up
            self._bg = threading.Thread(target=self._bg_loop, name="kv-transfer-progress", daemon=True)
            self._bg.start()

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of the local pool (a TP > 1 side's rank 0 holds only its heads)."""
        return self._pages.shape[1]

    @property
    def wire_page_bytes(self) -> int:
        """Bytes of one wire page: all KV heads (CompatInfo.page_bytes)."""
        return self._side.compat.page_bytes

    @property
    def bootstrap_port(self) -> int:
        """Actual port of the bootstrap server (prefill role)."""
        if not isinstance(self._side, PrefillSide):
            raise AttributeError("bootstrap_port exists on the prefill role only")
        return self._side.bootstrap.port

    def create_sender(self, room: int, prompt_ids: list[int] | None = None, namespace: str = "") -> KVSender:
        """`prompt_ids` lets the sender check a decode's cached prefix (decode-side reuse), hashed in
        the request's cache `namespace` (Req.cache_namespace: salted rooms never reuse unsalted pages)."""
        if not isinstance(self._side, PrefillSide):
            raise ValueError("create_sender needs role='prefill'")
        return self._side.create_sender(room, prompt_ids, namespace)

    def create_receiver(self, room: int, bootstrap_addr: str, dst_pages: list[int],
                        cached_ids: list[int] | None = None, staged: bool = False,
                        namespace: str = "") -> KVReceiver:
        """`cached_ids`: leading prompt ids (whole pages) whose KV this decode already holds, cached
        under the request's cache `namespace` (its hash names both);
        `dst_pages` are for the prompt's pages after them. `staged` (a TP > 1 decode, whose pool
        holds only rank 0's heads): each message lands in a buffer of full wire pages that the caller
        takes with `receiver.landed()` and scatters to its ranks; the pool is never written."""
        return self._decode_side("create_receiver").create_receiver(room, bootstrap_addr, dst_pages, cached_ids,
                                                                    staged, namespace)

    def decline_room(self, room: int, bootstrap_addr: str) -> None:
        """Decode: this worker prefills `room` itself; its prefill ends the room without computing."""
        self._decode_side("decline_room").decline(room, bootstrap_addr)

    def hold_room(self, room: int, bootstrap_addr: str) -> None:
        """Decode: `room` waits in this worker's queue for KV memory; its prefill is told so (heartbeats)
        and keeps it waiting, computing nothing, until create_receiver() or end_room(). ValueError: a bad
        bootstrap address."""
        self._decode_side("hold_room").hold(room, bootstrap_addr)

    def end_room(self, room: int, bootstrap_addr: str, reason: str, code: int = ErrorCode.ABORTED,
                 retry_after: int = 0) -> None:
        """Decode: this worker ends `room` without a receiver (refused, or ended while held): its prefill
        ends it too, with `reason`, `code` (HTTP-like, as ErrorCode) and `retry_after` (an overload
        refusal's seconds, 0: none). ValueError: a bad bootstrap address."""
        self._decode_side("end_room").end(room, bootstrap_addr, reason, code, retry_after)

    def ended_rooms(self) -> dict[int, TransferError]:
        """Decode: held rooms their prefill ended (or that ended with it) since the last call, with why."""
        return self._decode_side("ended_rooms").take_ended()

    def _decode_side(self, call: str) -> DecodeSide:
        if not isinstance(self._side, DecodeSide):
            raise ValueError(f"{call} needs role='decode'")
        return self._side

    def progress(self) -> None:
        """Drive zmq, UCX and timers once; never blocks."""
        self._backend.progress()
        self._side.handle_messages()
        self._side.step()
        self._backend.progress()
        now = time.monotonic()
        if now >= self._next_timers:
            self._next_timers = now + _TIMER_PERIOD_S
            self._side.check_timers(now)

    def idle_wait(self, timeout_s: float, extra: tuple = ()) -> None:
        """Block up to timeout_s (capped by the next timer) until a socket or UCX may have news.

        `extra`: more zmq sockets (or fds) to wake on, e.g. the worker's request socket."""
        timeout_s = min(timeout_s, max(0.0, self._next_timers - time.monotonic()))
        may_sleep, fd = self._backend.wait_fd()
        if not may_sleep or timeout_s <= 0:
            return
        poller = zmq.Poller()
        for sock in (*self._side.sockets(), *extra):
            poller.register(sock, zmq.POLLIN)
        if fd is not None:
            poller.register(fd, zmq.POLLIN)
        poller.poll(timeout_s * 1000.0)

    def wakeups(self) -> tuple:
        """The sockets (and UCX fd) whose news this manager's progress() handles: for a worker that waits on
        another manager's idle_wait (extra=...) as well."""
        may_sleep, fd = self._backend.wait_fd()
        return (*self._side.sockets(), *((fd,) if may_sleep and fd is not None else ()))

    @contextmanager
    def background(self) -> Iterator[None]:
        """Hand the transfer state to the progress thread while the body (a forward) runs; the body
        must not call this manager or its rooms. Without a progress thread it does nothing."""
        if self._bg is None:
            yield
            return
        self._bg_on.set()
        self._lock.release()
        try:
            yield
        finally:
            self._bg_on.clear()
            try:
                os.write(self._wake_w, b"x")  # cut the thread's idle wait short
            except BlockingIOError:
                pass
            self._lock.acquire()

    def _bg_loop(self) -> None:
        while True:
            self._bg_on.wait()
            with self._lock:
                if self._bg_stop:
                    return
                if not self._bg_on.is_set():
                    continue  # the worker is taking the state back
                t0 = time.monotonic()
                try:
                    self.progress()
                    self._bg_passes += 1
                    self.idle_wait(0.05, extra=(self._wake_r,))
                except Exception:  # never let the thread die silently; the worker's own calls surface it
                    log.exception("transfer progress thread")
                    time.sleep(0.01)
                self._drain_wakeups()
                busy = time.monotonic() - t0 < _BG_MIN_PASS_S
            if busy:
                # The pass did not sleep on a socket (UCX had work, or a timer was due). Pause with the
                # GIL released: a thread that keeps the GIL busy convoys the forward, whose torch ops
                # release and retake the GIL many times per step.
                time.sleep(_BG_MIN_PASS_S)

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass

    def active_rooms(self) -> int:
        """Rooms created and not yet released (0 once every room ended and was released)."""
        side = self._side
        return len(side.senders) if isinstance(side, PrefillSide) else len(side.receivers)

    def stats(self) -> LinkStats:
        """The link's levels (rooms, queued/in-flight messages, staging, peers) and totals, typed."""
        return replace(self._side.stats(), backend_sinks=getattr(self._backend, "pending_sinks", 0),
                       background_passes=self._bg_passes)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._bg is not None:
            self._bg_stop = True
            self._bg_on.set()
            self._lock.release()
            self._bg.join(5.0)
            self._lock.acquire()
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._side.close()
        self._backend.close()
        self._zctx.term()

    def __enter__(self) -> TransferManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
