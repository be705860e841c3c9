"""Prefill side of the transfer manager: bootstrap server, control endpoint, senders.

1. The bootstrap server (ROUTER on advertise_host:bootstrap_port) answers a decode's BootstrapQuery
   with this worker's PrefillRegistration (control endpoint + UCX address).
2. The control endpoint (ROUTER, free port) takes TransferInfo. It is checked (cluster token,
   compatibility hash: a mismatch names the field, duplicate room) and acked with
   TransferStatus(WAITING_FOR_INPUT), or refused with an Abort. A TransferInfo that arrives before
   create_sender() is buffered for up to bootstrap_timeout_s. Decode-side prefix reuse: a
   TransferInfo with cached_tokens > 0 is accepted only when prefix_hash of this room's own first
   cached_tokens prompt ids equals its cached_hash (the sender then skips that many pages,
   `KVSender.reused_pages`); otherwise it is refused with Abort(PREFIX_MISMATCH) and the room stays
   BOOTSTRAPPING, waiting for the decode's second TransferInfo (the whole prompt).
3. Each send() queues pages; step() posts them over UCX and sends a ChunkManifest per chunk.
4. The decode's TransferStatus(SUCCESS) plus all local sends done -> sender SUCCESS.
Queued rooms: a decode busy with other requests holds a room in its queue until it has KV memory for
it, and every Heartbeat it sends lists the rooms it holds with this prefill; a room still BOOTSTRAPPING
that a heartbeat lists is queued there, and its bootstrap timer counts from that word (nothing is
computed or held here meanwhile). A decode that ends a queued room (its queue full, its queue deadline
passed, an abort) sends an Abort for it: the sender fails with the decode's reason, or, when
create_sender() has not come yet, the refusal is kept for bootstrap_timeout_s and fails it then.
Timers: no TransferInfo within bootstrap_timeout_s (of creation, or of the decode's last word that
the room is queued) -> FAILED; a decode silent for 3 heartbeat intervals -> its rooms FAILED and its
UCX endpoint closed.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import zmq

from transfer.backend import DataBackend, Handle
from transfer.config import CompatInfo, TransferConfig
from transfer.control import ControlRouter, Dropped
from transfer.messages import (
    Abort,
    AbortAck,
    BootstrapQuery,
    ChunkManifest,
    Heartbeat,
    PrefillRegistration,
    TransferInfo,
    TransferStatus,
    prefix_hash,
)
from transfer.rooms import KVSender
from transfer.state import TERMINAL, ErrorCode, KVPoll, TransferError
from transfer.stats import LinkStats

log = logging.getLogger(__name__)


class PrefillSide:
    def __init__(self, cfg: TransferConfig, zctx: zmq.Context, engine_id: str, backend: DataBackend,
                 pages: torch.Tensor, compat: CompatInfo) -> None:
        self.cfg, self.backend, self.pages, self.compat = cfg, backend, pages, compat
        self._hash = compat.digest()
        self.dropped = Dropped()
        self.bootstrap = ControlRouter(zctx, cfg.advertise_host, cfg.bootstrap_port, cfg.cluster_token,
                                       self.dropped)
        try:
            self.control = ControlRouter(zctx, cfg.advertise_host, 0, cfg.cluster_token, self.dropped)
        except ValueError:
            self.bootstrap.close()
            raise
        self.registration = PrefillRegistration(engine_id, self.control.endpoint, backend.address)
        self.senders: dict[int, KVSender] = {}
        self.early: dict[int, tuple[TransferInfo, bytes, float]] = {}  # room -> info, peer, arrival
        self.rejected: dict[int, tuple[TransferError, float]] = {}  # refused before create_sender
        self.peers: dict[bytes, float] = {}  # decode identity -> last message time
        self.peer_ucx: dict[bytes, bytes] = {}
        self.draining: list[Handle] = []
        self.aborts_unacked: dict[int, float] = {}
        self.prefix_refusals = 0  # TransferInfos whose cached prefix did not match the prompt
        self.kept_queued = 0  # rooms kept past bootstrap_timeout_s because their decode said they were queued

    # ---- API -------------------------------------------------------------------------------
    def create_sender(self, room: int, prompt_ids: list[int] | None = None, namespace: str = "") -> KVSender:
        """`prompt_ids`: the room's prompt, to check a decode's cached prefix against (None: a
        TransferInfo with cached_tokens is always refused), hashed in the request's cache
        `namespace` (Req.cache_namespace)."""
        if room in self.senders:
            raise TransferError(ErrorCode.DUPLICATE_ROOM, f"room {room}: a sender already exists")
        sender = KVSender(room, self._notify, self.release, self.pages, self.backend)
        sender.prompt_ids = prompt_ids
        sender.namespace = namespace
        self.senders[room] = sender
        if room in self.rejected:
            err, _ = self.rejected.pop(room)
            sender.fail(err.code, err.message.removeprefix(f"room {room}: "), peer_fault=err.peer_fault,
                        retry_after=err.retry_after)
        elif room in self.early:
            info, identity, _ = self.early.pop(room)
            if info.local_prefill:
                sender.decline()
            else:
                self._accept(sender, identity, info)
        return sender

    def _accept(self, sender: KVSender, identity: bytes, info: TransferInfo) -> None:
        """Take the decode's TransferInfo, or refuse a cached prefix this prompt does not start with."""
        why = self._prefix_problem(info, sender.prompt_ids, sender.namespace)
        if why is not None:
            log.info("room %d: decode's cached prefix refused (%s): it sends the whole prompt's pages", info.room, why)
            self.prefix_refusals += 1
            self.control.send(identity, Abort(info.room, why, ErrorCode.PREFIX_MISMATCH))
            return
        sender.accept(identity, info.ucx_address, list(info.dst_pages), info.metadata_slot,
                      info.cached_tokens // self.compat.page_size)

    def _prefix_problem(self, info: TransferInfo, prompt_ids: list[int] | None,
                        namespace: str = "") -> str | None:
        n = info.cached_tokens
        if not n:
            return None
        if prompt_ids is None:
            return "this prefill cannot check a cached prefix"
        if n < 0 or n % self.compat.page_size or n >= len(prompt_ids):
            return f"cached_tokens {n} is not whole pages before the last of {len(prompt_ids)} prompt tokens"
        if (prefix_hash(prompt_ids[:n], namespace) if namespace else prefix_hash(prompt_ids[:n])) != info.cached_hash:
            return f"the decode's {n} cached tokens are not this prompt's (hash mismatch)"
        return None

    def sockets(self) -> list[zmq.Socket]:
        return [self.bootstrap.sock, self.control.sock]

    # ---- messages --------------------------------------------------------------------------
    def handle_messages(self) -> None:
        for identity, msg, ok in self.bootstrap.recv_all():
            if not isinstance(msg, BootstrapQuery):
                self.dropped.add("unexpected", f"{type(msg).__name__} on the bootstrap server")
                continue
            if not ok:
                self.dropped.add("unauthorized", "BootstrapQuery")
                self.bootstrap.send(identity, Abort(0, "bootstrap refused: missing or wrong cluster token",
                                                    ErrorCode.UNAUTHORIZED))
                continue
            self.bootstrap.send(identity, PrefillRegistration(**{
                k: getattr(self.registration, k) for k in ("engine_id", "control_endpoint", "ucx_address")}))
        for identity, msg, ok in self.control.recv_all():
            if not ok:
                self.dropped.add("unauthorized", type(msg).__name__)
                if isinstance(msg, TransferInfo):
                    self.control.send(identity, Abort(msg.room, "refused: missing or wrong cluster token",
                                                      ErrorCode.UNAUTHORIZED))
                continue
            self.peers[identity] = time.monotonic()
            self._dispatch(identity, msg)

    def _dispatch(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, TransferInfo):
            self._on_transfer_info(identity, msg)
        elif isinstance(msg, TransferStatus) and msg.state == KVPoll.SUCCESS:
            s = self.senders.get(msg.room)
            if s is not None and s.peer_identity == identity:
                s.on_ack()
        elif isinstance(msg, Abort):
            self._on_abort(identity, msg)
        elif isinstance(msg, AbortAck):
            self.aborts_unacked.pop(msg.room, None)
        elif isinstance(msg, Heartbeat):
            self._on_queued(identity, msg.rooms)
            self.control.send(identity, Heartbeat(self.registration.engine_id, msg.seq))
        elif not isinstance(msg, TransferStatus):
            self.dropped.add("unexpected", f"{type(msg).__name__} on the control endpoint")

    def _on_transfer_info(self, identity: bytes, info: TransferInfo) -> None:
        room = info.room
        if info.local_prefill:  # the decode computes this prompt itself
            sender = self.senders.get(room)
            if sender is None:
                self.early[room] = (info, identity, time.monotonic())
            elif sender.peer_identity is None:
                sender.decline()
            return
        problem = self._check_info(info)
        if problem is not None:
            code, message = problem
            self.control.send(identity, Abort(room, message, code))
            sender = self.senders.get(room)
            if code != ErrorCode.DUPLICATE_ROOM:
                if sender is not None:
                    sender.fail(code, message)
                else:
                    self.rejected[room] = (TransferError(code, f"room {room}: {message}"), time.monotonic())
            return
        self.peer_ucx[identity] = info.ucx_address
        self.control.send(identity, TransferStatus(room, int(KVPoll.WAITING_FOR_INPUT)))
        sender = self.senders.get(room)
        if sender is None:
            self.early[room] = (info, identity, time.monotonic())
        else:
            self._accept(sender, identity, info)

    def _check_info(self, info: TransferInfo) -> tuple[ErrorCode, str] | None:
        if info.compat_hash != self._hash:
            why = self.compat.mismatch(info.compat) or "KV compatibility hash mismatch"
            return ErrorCode.INCOMPATIBLE, why
        sender = self.senders.get(info.room)
        if info.room in self.early or (sender is not None and sender.peer_identity is not None):
            return ErrorCode.DUPLICATE_ROOM, f"room {info.room} already has a TransferInfo from a decode"
        if not info.dst_pages or any(not isinstance(p, int) or p < 0 for p in info.dst_pages):
            return ErrorCode.BAD_REQUEST, "TransferInfo needs a non-empty list of page indices"
        if not 0 < info.metadata_slot < (1 << 32):
            return ErrorCode.BAD_REQUEST, f"metadata_slot {info.metadata_slot} out of range"
        return None

    def _on_queued(self, identity: bytes, rooms: list) -> None:
        """A decode's heartbeat lists the rooms it holds with us: one of them still BOOTSTRAPPING here
        waits in that decode's queue for KV memory, so its bootstrap timer starts again now."""
        now = time.monotonic()
        for room in rooms:
            sender = self.senders.get(room) if isinstance(room, int) else None
            if sender is not None and sender.state == KVPoll.BOOTSTRAPPING and sender.queued_by in (None, identity):
                sender.queued_at, sender.queued_by = now, identity

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        """The decode ended a room: fail ours if it is that decode's (its TransferInfo accepted, or the
        room not yet claimed by another decode: one that waited in its queue, or that it refused); a
        room create_sender() has not opened yet is refused when it comes."""
        self.control.send(identity, AbortAck(msg.room))
        early = self.early.get(msg.room)
        if early is not None and early[1] == identity:
            del self.early[msg.room]
        code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else ErrorCode.ABORTED
        why = msg.reason if msg.retry_after else f"aborted by decode: {msg.reason}"  # overloaded: its own words
        sender = self.senders.get(msg.room)
        if sender is None:
            err = TransferError(code, f"room {msg.room}: {why}", True, msg.retry_after)
            self.rejected[msg.room] = (err, time.monotonic())
        elif sender.peer_identity == identity or (sender.peer_identity is None
                                                  and sender.queued_by in (None, identity)):
            sender.fail(code, why, peer_fault=True, retry_after=msg.retry_after)

    def _notify(self, room: int, reason: str, code: ErrorCode) -> None:
        """Abort the room at its decode: the one whose TransferInfo it took, or the one it waits for."""
        sender = self.senders.get(room)
        identity = (sender.peer_identity or sender.queued_by) if sender is not None else None
        if identity is not None:
            self.control.send(identity, Abort(room, reason, int(code)))
            self.aborts_unacked[room] = time.monotonic()

    # ---- data + timers ---------------------------------------------------------------------
    def step(self) -> None:
        for sender in self.senders.values():
            for segments, total, is_last, meta in sender.post():
                self.control.send(sender.peer_identity, ChunkManifest(sender.room, segments, total,
                                                                      is_last, meta))
            sender.check()
            if sender.state in TERMINAL:
                self.draining.extend(sender.drain())
        self.draining = [h for h in self.draining if not h.done]

    def check_timers(self, now: float) -> None:
        cfg = self.cfg
        for sender in self.senders.values():
            if sender.state == KVPoll.BOOTSTRAPPING:
                self._check_bootstrap(sender, now)
        for room, (_, identity, t) in list(self.early.items()):
            if now - t > cfg.bootstrap_timeout_s:
                del self.early[room]
                self.control.send(identity, Abort(room, f"no prefill request for room {room} within "
                                                  f"{cfg.bootstrap_timeout_s}s", ErrorCode.TIMEOUT))
        for room, (_, t) in list(self.rejected.items()):
            if now - t > cfg.bootstrap_timeout_s:
                del self.rejected[room]
        for room, t in list(self.aborts_unacked.items()):
            if now - t > cfg.peer_lost_s:
                del self.aborts_unacked[room]
        for identity, seen in list(self.peers.items()):
            if now - seen > cfg.peer_lost_s:
                self._peer_lost(identity)

    def _check_bootstrap(self, sender: KVSender, now: float) -> None:
        """Fail a room with no TransferInfo for bootstrap_timeout_s since it was created or since its
        decode last said it was queued; count a queued room the first time it outlives the timeout."""
        limit = self.cfg.bootstrap_timeout_s
        if now - max(sender.created_at, sender.queued_at) > limit:
            queued = now - sender.queued_at
            since = f" (its decode last said it was queued {queued:.1f}s ago)" if sender.queued_at else ""
            sender.fail(ErrorCode.TIMEOUT, f"no TransferInfo from a decode within {limit}s{since}",
                        tell_peer=sender.queued_by is not None, peer_fault=True)
        elif now - sender.created_at > limit and not sender.kept_queued:
            sender.kept_queued = True
            self.kept_queued += 1

    def _peer_lost(self, identity: bytes) -> None:
        del self.peers[identity]
        lost = [s for s in self.senders.values() if s.peer_identity == identity and s.state not in TERMINAL]
        for s in lost:
            s.fail(ErrorCode.PEER_LOST, f"decode missed 3 heartbeats ({self.cfg.peer_lost_s:g}s)",
                   peer_fault=True)
            self.draining.extend(s.drain())
        for room in [r for r, (_, i, _) in self.early.items() if i == identity]:
            del self.early[room]
        ucx = self.peer_ucx.pop(identity, None)
        if ucx is not None and lost:
            self.backend.disconnect(ucx)  # cancels sends to the dead peer
            self.draining = [h for h in self.draining if not h.done]

    def release(self, room: int) -> None:
        sender = self.senders.pop(room, None)
        if sender is not None:
            self.draining.extend(sender.drain())

    def stats(self) -> LinkStats:
        return LinkStats(senders=len(self.senders), early_infos=len(self.early),
                         pending_sends=sum(s.pending() for s in self.senders.values()),
                         draining=len(self.draining), peers=len(self.peers),
                         prefix_refusals=self.prefix_refusals, kept_queued=self.kept_queued,
                         control_dropped=dict(self.dropped.counts))

    def close(self) -> None:
        self.bootstrap.close()
        self.control.close()
