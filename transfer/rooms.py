"""Per-room state: KVSender (prefill side) and KVReceiver (decode side).

A room object owns its queued chunks, in-flight UCX handles and staging buffers, and frees them
the moment it reaches FAILED or SUCCESS; the manager drops the object itself on release().
Rooms talk to their side only through two callbacks: notify(room, reason, code) sends the peer
an Abort, on_release(room) drops the room's bookkeeping.

pages: uint8 [num_pages, page_bytes] view of the KV pool (layout.page_view). A TP > 1 side stages:
its sender is handed each chunk's full wire pages (`send(..., data=)`); its receiver receives every
message into a buffer of full wire pages and hands them over (`landed()`) for the decode to scatter
to its ranks (engine/distributed/tp_kv.py), so staging holds only the messages not yet stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from transfer.backend import DataBackend, Handle, make_tag
from transfer.layout import Segment, is_consecutive, plan_segments
from transfer.state import TERMINAL, ErrorCode, KVPoll, TransferError

log = logging.getLogger(__name__)
Notify = Callable[[int, str, ErrorCode], None]
OnRelease = Callable[[int], None]


class _Room:
    def __init__(self, room: int, notify: Notify, on_release: OnRelease) -> None:
        self.room = room
        self.state = KVPoll.BOOTSTRAPPING
        self.error: TransferError | None = None
        self.created_at = time.monotonic()
        self.released = False
        self._notify = notify
        self._on_release = on_release

    def poll(self) -> KVPoll:
        return self.state

    @property
    def moved(self) -> tuple:
        """Changes whenever the room moves (its state, and its pages as they go): the watchdog's mark."""
        return (self.state,)

    def fail(self, code: ErrorCode, message: str, tell_peer: bool = False, peer_fault: bool = False,
             retry_after: int = 0) -> bool:
        """Move to FAILED (once), free buffers; tell the peer with an Abort when asked. `peer_fault`:
        the other side caused it; `retry_after`: it refused the room as overloaded (see TransferError)."""
        if self.state in TERMINAL:
            return False
        self.state = KVPoll.FAILED
        self.error = TransferError(code, f"room {self.room}: {message}", peer_fault, retry_after)
        self._free()
        log.info("%s FAILED: %s", type(self).__name__, self.error.message)
        if tell_peer:
            self._notify(self.room, message, code)
        return True

    def abort(self, reason: str) -> None:
        """Fail this room now and tell the peer, which fails its side with the reason."""
        self.fail(ErrorCode.ABORTED, f"aborted: {reason}", tell_peer=True)

    def release(self) -> None:
        """Drop bookkeeping; a room still running is aborted first."""
        if self.state not in TERMINAL:
            self.abort("released before the transfer ended")
        if not self.released:
            self.released = True
            self._on_release(self.room)

    def _free(self) -> None:
        raise NotImplementedError


@dataclass
class _Chunk:
    segments: list[Segment]
    buffers: list[torch.Tensor]  # one uint8 [n_pages, page_bytes] per segment
    total_pages: int
    is_last: bool
    metadata: dict | None
    ready: torch.cuda.Event | None = None  # CUDA: set after the gathers; post when it completed


class KVSender(_Room):
    """Prefill side of one room. Pages queued by send() are posted as UCX messages by progress()."""

    def __init__(self, room: int, notify: Notify, on_release: OnRelease, pages: torch.Tensor,
                 backend: DataBackend) -> None:
        super().__init__(room, notify, on_release)
        self.num_dst_pages = 0
        self.peer_identity: bytes | None = None
        self._pages = pages
        self._backend = backend
        self._peer_ucx = b""
        self._dst_pages: list[int] = []
        self._slot = 0
        self._cursor = 0
        self._next_seq = 0
        self._sent_last = False
        self._acked = False
        self._queue: list[_Chunk] = []
        self._inflight: list[Handle] = []
        self.declined = False  # the decode prefills this prompt itself; SUCCESS with nothing sent
        self.prompt_ids: list[int] | None = None  # to check a decode's cached prefix (PrefillSide)
        self.namespace = ""  # the prompt's cache namespace (Req.cache_namespace), in that check's hash
        self.reused_pages = 0  # leading prompt pages the decode already holds: never sent
        # while BOOTSTRAPPING: the room waits in a decode's queue for KV memory (its heartbeats list it);
        # the bootstrap timer counts from `queued_at`, the decode's last such word (PrefillSide)
        self.queued_at = 0.0
        self.queued_by: bytes | None = None  # that decode's control identity
        self.kept_queued = False  # it outlived the bootstrap timeout thanks to that word (counted once)

    @property
    def moved(self) -> tuple:
        # queued_at: the room waits in its decode's queue, and the decode says so (its queue deadline bounds it)
        return (self.state, self._cursor, self._next_seq, self._acked, self.queued_at)

    def decline(self) -> None:
        """The decode computes the prompt itself: BOOTSTRAPPING -> SUCCESS, nothing to send."""
        if self.state == KVPoll.BOOTSTRAPPING:
            self.declined = True
            self.state = KVPoll.SUCCESS
            self._free()

    def accept(self, identity: bytes, ucx_address: bytes, dst_pages: list[int], slot: int,
               reused_pages: int = 0) -> None:
        """TransferInfo arrived: BOOTSTRAPPING -> WAITING_FOR_INPUT. `reused_pages`: the decode holds
        the prompt's first pages already; dst position 0 is prompt page `reused_pages`, and the
        caller sends from there on."""
        self.peer_identity, self._peer_ucx, self.reused_pages = identity, ucx_address, reused_pages
        self._dst_pages, self._slot, self.num_dst_pages = dst_pages, slot, len(dst_pages)
        if self.state == KVPoll.BOOTSTRAPPING:
            self.state = KVPoll.WAITING_FOR_INPUT

    def send(self, src_pages: list[int], is_last: bool, metadata: dict | None = None,
             data: torch.Tensor | None = None) -> None:
        """Queue one chunk's pages (mapped onto dst pages by position); progress() sends them.

        `data` (a TP > 1 prefill): uint8 [len(src_pages), wire page_bytes], the chunk's pages already
        gathered into full wire pages (row i = src_pages[i]); they are sent from it instead of the pool,
        and the chunk keeps it alive until its sends are done."""
        if self.state == KVPoll.FAILED:
            return  # a failure raced with the scheduler; poll() reports it
        if self.state == KVPoll.BOOTSTRAPPING:
            raise ValueError(f"room {self.room}: send() before the decode's TransferInfo arrived")
        if self._sent_last or self.state == KVPoll.SUCCESS:
            raise ValueError(f"room {self.room}: send() after the last chunk")
        if metadata is not None and not is_last:
            raise ValueError(f"room {self.room}: metadata only goes with is_last")
        if any(not 0 <= p < self._pages.shape[0] for p in src_pages):
            raise ValueError(f"room {self.room}: source page out of range 0..{self._pages.shape[0] - 1}")
        pages = self._pages  # uint8 [num_pages, page_bytes]
        if data is not None:  # staged: row i holds src_pages[i]
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[0] != len(src_pages) \
                    or not data.is_contiguous():
                raise ValueError(f"room {self.room}: data must be contiguous uint8 [{len(src_pages)}, "
                                 f"page_bytes], got {data.dtype} {tuple(data.shape)}")
            pages, src_pages = data, list(range(len(src_pages)))
        end = self._cursor + len(src_pages)
        if end > self.num_dst_pages or (is_last and end != self.num_dst_pages):
            self.fail(ErrorCode.BAD_REQUEST, f"prefill sends {end} pages but the decode reserved "
                      f"{self.num_dst_pages}", tell_peer=True)
            return
        segs = plan_segments(src_pages, self._dst_pages, self._cursor, pages.shape[1])
        bufs = [pages[s.src_pages[0]:s.src_pages[-1] + 1] if s.src_direct
                else pages.index_select(0, torch.tensor(s.src_pages, device=pages.device))
                for s in segs]  # each uint8 [n, page_bytes]
        ready = None
        if pages.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._queue.append(_Chunk(segs, bufs, end, is_last, metadata, ready))
        self._cursor, self._sent_last = end, is_last
        self.state = KVPoll.TRANSFERRING

    def post(self) -> list[tuple[list[list], int, bool, dict | None]]:
        """Post queued chunks whose data is ready; returns their manifests (segments, total, last, meta)."""
        manifests = []
        while self._queue and self.state == KVPoll.TRANSFERRING:
            chunk = self._queue[0]
            if chunk.ready is not None and not chunk.ready.query():
                break
            self._queue.pop(0)
            wire = []
            for seg, buf in zip(chunk.segments, chunk.buffers):
                tag = make_tag(self._slot, self._next_seq)
                self._inflight.append(self._backend.send(self._peer_ucx, tag, buf.reshape(-1)))
                wire.append([self._next_seq, seg.positions])
                self._next_seq += 1
            manifests.append((wire, chunk.total_pages, chunk.is_last, chunk.metadata))
        return manifests

    def check(self) -> None:
        """Reap finished sends; SUCCESS once everything is sent, done and acked by the decode."""
        if self.state != KVPoll.TRANSFERRING:
            return
        if self._sent_last and not self._queue and self._acked:
            # The decode holds every byte: a send still finishing its protocol (or reset by a decode
            # that already exited) no longer reads our pages; the manager drains its handle.
            self.state = KVPoll.SUCCESS
            self._free()
            return
        for h in self._inflight:
            if h.done and h.error:
                self.fail(ErrorCode.TRANSPORT, f"UCX send failed: {h.error}", tell_peer=True)
                return
        self._inflight = [h for h in self._inflight if not h.done]

    def on_ack(self) -> None:
        self._acked = True
        self.check()

    def pending(self) -> int:
        return len(self._queue) + len(self._inflight)

    def drain(self) -> list[Handle]:
        """Sends still in flight after a failure (their buffers live in the handles)."""
        out, self._inflight = self._inflight, []
        return out

    def _free(self) -> None:
        self._queue.clear()


@dataclass
class _Recv:
    handle: Handle
    dst: list[int]
    staging: torch.Tensor | None  # uint8 [n, page_bytes] when dst pages are not consecutive


@dataclass
class _Expect:
    tag: int
    dst: list[int] = field(default_factory=list)


class KVReceiver(_Room):
    """Decode side of one room: probes announced tags, receives into dst pages, reports SUCCESS."""

    def __init__(self, room: int, notify: Notify, on_release: OnRelease, pages: torch.Tensor,
                 backend: DataBackend, dst_pages: list[int], slot: int, bootstrap_addr: str,
                 staged_page_bytes: int = 0) -> None:
        super().__init__(room, notify, on_release)
        # staged (a TP > 1 decode): every message lands in its own buffer of full wire pages
        # (staged_page_bytes each) that the caller takes with landed(); the pool is never written
        self._staged_page_bytes = staged_page_bytes
        self._landed: list[tuple[list[int], torch.Tensor]] = []
        self.metadata: dict | None = None
        self.dst_pages = dst_pages
        self.slot = slot
        self.bootstrap_addr = bootstrap_addr
        self._pages = pages
        self._backend = backend
        self._expect: list[_Expect] = []
        self._recvs: list[_Recv] = []
        self._done_pages = 0
        self._total_pages = 0
        self._last_seen = False
        self._pending_meta: dict | None = None
        self._orphans: list[Handle] = []

    @property
    def moved(self) -> tuple:
        return (self.state, self._done_pages, self._total_pages)

    def on_ack(self) -> None:
        if self.state == KVPoll.BOOTSTRAPPING:
            self.state = KVPoll.WAITING_FOR_INPUT

    def on_manifest(self, segments: list[list], total: int, is_last: bool, metadata: dict | None) -> None:
        if self.state in TERMINAL:
            return
        self.state = KVPoll.TRANSFERRING
        for seq, positions in segments:
            if not positions or any(not 0 <= p < len(self.dst_pages) for p in positions):
                self.fail(ErrorCode.BAD_REQUEST, f"manifest positions {positions} outside "
                          f"{len(self.dst_pages)} dst pages", tell_peer=True)
                return
            self._expect.append(_Expect(make_tag(self.slot, seq), [self.dst_pages[p] for p in positions]))
        self._total_pages, self._last_seen = total, is_last
        if is_last:
            self._pending_meta = metadata or {}

    def step(self) -> bool:
        """Probe, receive, scatter; returns True on reaching SUCCESS (the caller acks the prefill)."""
        if self.state != KVPoll.TRANSFERRING:
            return False
        page_bytes = self._staged_page_bytes or self._pages.shape[1]
        waiting = []
        for exp in self._expect:
            nbytes = len(exp.dst) * page_bytes
            probe = self._backend.probe(exp.tag, nbytes)
            if probe is None:
                waiting.append(exp)
                continue
            if probe.length != nbytes:
                self.fail(ErrorCode.TRANSPORT, f"message {exp.tag:#x} has {probe.length} bytes, "
                          f"expected {nbytes}", tell_peer=True)
                return False
            if is_consecutive(exp.dst) and not self._staged_page_bytes:
                buf, staging = self._pages[exp.dst[0]:exp.dst[-1] + 1], None  # [n, page_bytes] view
            else:
                staging = torch.empty((len(exp.dst), page_bytes), dtype=torch.uint8,
                                      device=self._pages.device)
                buf = staging
            self._recvs.append(_Recv(self._backend.recv(probe, buf.reshape(-1)), exp.dst, staging))
        self._expect = waiting
        return self._reap()

    def _reap(self) -> bool:
        still = []
        for r in self._recvs:
            if not r.handle.done:
                still.append(r)
                continue
            if r.handle.error:
                self.fail(ErrorCode.TRANSPORT, f"UCX receive failed: {r.handle.error}", tell_peer=True)
                return False
            if self._staged_page_bytes:  # the caller stores them (each rank its heads)
                self._landed.append((r.dst, r.staging))  # type: ignore[arg-type]
            elif r.staging is not None:  # scatter: pages[dst[i]] = staging[i]
                self._pages.index_copy_(0, torch.tensor(r.dst, device=self._pages.device), r.staging)
            self._done_pages += len(r.dst)
        self._recvs = still
        if not (self._last_seen and not self._expect and not self._recvs):
            return False
        return self._finish()

    def _finish(self) -> bool:
        meta = self._pending_meta or {}
        if self._done_pages != len(self.dst_pages) or self._total_pages != len(self.dst_pages):
            self.fail(ErrorCode.BAD_REQUEST, f"received {self._done_pages} pages, reserved "
                      f"{len(self.dst_pages)}", tell_peer=True)
            return False
        if "room" in meta and meta["room"] != self.room:
            self.fail(ErrorCode.BAD_REQUEST, f"metadata names room {meta['room']}", tell_peer=True)
            return False
        self.metadata = meta
        self.state = KVPoll.SUCCESS
        self._free()
        return True

    def landed(self) -> list[tuple[list[int], torch.Tensor]]:
        """A staged receiver's messages received since the last call: (dst pages, uint8 [len, wire
        page_bytes] full pages), in arrival order; the caller stores them. Call it before acting on
        SUCCESS (the last pages are here then); after FAILED it is empty."""
        out, self._landed = self._landed, []
        return out

    def pending(self) -> int:
        return len(self._expect) + len(self._recvs)

    def staging_bytes(self) -> int:
        held = [r.staging for r in self._recvs if r.staging is not None] + [b for _, b in self._landed]
        return sum(b.numel() for b in held)

    def drain(self) -> list[Handle]:
        """Receives still in flight after a failure: ucxx cannot cancel them, but they were probed,
        so their bytes have arrived or are arriving; the manager keeps the handles until done."""
        out, self._orphans = self._orphans, []
        return out

    def _free(self) -> None:
        self._orphans = [r.handle for r in self._recvs if not r.handle.done]
        self._expect.clear()
        self._recvs.clear()
        if self.state == KVPoll.FAILED:
            self._landed.clear()  # never stored: the room's pages are given back
