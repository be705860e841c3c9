"""Decode side of the transfer manager: bootstrap client, receivers, heartbeats.

1. create_receiver(room, "host:port", dst_pages): the first room for a prefill sends a
   BootstrapQuery to its bootstrap server; the PrefillRegistration answer names the control
   endpoint, which this side connects to (DEALER, identity = engine id).
2. TransferInfo (UCX address, dst pages, slot, compatibility hash; with decode-side prefix reuse
   the cached prefix's length and prefix_hash, dst pages then covering only the pages after it) goes
   out; the prefill acks it (WAITING_FOR_INPUT) or aborts (token, hash mismatch naming the field,
   duplicate room; PREFIX_MISMATCH: the caller releases the receiver and asks again, whole).
3. Each ChunkManifest announces tagged UCX messages; the receiver probes for them and receives
   straight into consecutive dst pages, or into a staging buffer it scatters.
4. All pages + metadata in place -> SUCCESS, acked to the prefill with TransferStatus(SUCCESS).
Queued rooms: hold(room, "host:port") before a receiver exists, while the request waits in this
decode's queue for KV memory (the peer is bootstrapped if needed). Every Heartbeat to that prefill
lists the rooms held with it (and those in flight), so it keeps them waiting: heartbeats go out while
any room is held, at least 3 times per bootstrap_timeout_s (the prefill's timer). create_receiver()
takes the hold over; end(room, ...) drops it and tells the prefill to end the room too (an Abort). A
held room the prefill ends (its Abort), or whose prefill is lost, is reported by take_ended().
Timers: KV not complete within waiting_timeout_s -> FAILED + Abort; a prefill silent for 3
heartbeat intervals -> its rooms FAILED and the peer forgotten (the next room bootstraps again).
A peer silent for a heartbeat interval with no room in flight may have been restarted at the same
address (its rooms ended before heartbeats could miss): its next room asks the bootstrap server
again first (messages wait meanwhile) and keeps the control connection only if the same process
(engine id, control endpoint) answers.
Slots of ended rooms are swept for late UCX messages for SLOT_QUARANTINE_S.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from transfer.backend import DataBackend, Handle
from transfer.config import CompatInfo, TransferConfig
from transfer.control import ControlDealer, Dropped
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
from transfer.rooms import KVReceiver
from transfer.state import TERMINAL, ErrorCode, KVPoll, TransferError
from transfer.stats import LinkStats

log = logging.getLogger(__name__)
SLOT_QUARANTINE_S = 60.0
SWEEP_INTERVAL_S = 0.05


@dataclass
class _Peer:
    addr: str
    boot: ControlDealer
    last_seen: float
    ctrl: ControlDealer | None = None
    pending: list[Any] = field(default_factory=list)  # messages waiting for the control connection
    rooms: set[int] = field(default_factory=set)
    hb_seq: int = 0
    engine_id: str = ""  # of the process that registered
    parked: ControlDealer | None = None  # the control connection while its process is asked again

    def send(self, msg: Any) -> None:
        if self.ctrl is not None:
            self.ctrl.send(msg)
        else:
            self.pending.append(msg)

    def recheck(self, query: BootstrapQuery) -> None:
        """Ask the bootstrap server who serves this address now; sends wait for the answer."""
        self.parked, self.ctrl = self.ctrl, None
        self.boot.send(query)

    def close(self) -> None:
        self.boot.close()
        for c in (self.ctrl, self.parked):
            if c is not None:
                c.close()


def _valid_segments(segments: list) -> bool:
    return all(isinstance(s, list) and len(s) == 2 and isinstance(s[0], int) and isinstance(s[1], list)
               and all(isinstance(p, int) for p in s[1]) for s in segments)


def _hash(ids: list[int], namespace: str) -> str:
    """prefix_hash of a cached prefix in its namespace (the one-argument call when there is none)."""
    return prefix_hash(ids, namespace) if namespace else prefix_hash(ids)


def _parse_addr(addr: str) -> str:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bootstrap address must be host:port, got {addr!r}")
    return f"tcp://{host}:{port}"


class DecodeSide:
    def __init__(self, cfg: TransferConfig, zctx: zmq.Context, engine_id: str, backend: DataBackend,
                 pages: torch.Tensor, compat: CompatInfo) -> None:
        self.cfg, self.zctx, self.engine_id = cfg, zctx, engine_id
        self.backend, self.pages, self.compat = backend, pages, compat
        self.receivers: dict[int, KVReceiver] = {}
        self.peers: dict[str, _Peer] = {}
        self.dropped = Dropped()
        self.dead_slots: dict[int, float] = {}  # slot -> quarantine end
        self.held: dict[int, str] = {}  # room waiting in this decode's queue -> its bootstrap address
        self.ended: dict[int, TransferError] = {}  # held rooms the prefill ended (take_ended)
        self.draining: list[Handle] = []
        self._next_slot = random.randrange(1, 1 << 31)
        self._next_hb = 0.0
        self._next_sweep = 0.0

    # ---- API -------------------------------------------------------------------------------
    def create_receiver(self, room: int, bootstrap_addr: str, dst_pages: list[int],
                        cached_ids: list[int] | None = None, staged: bool = False,
                        namespace: str = "") -> KVReceiver:
        """`cached_ids`: the prompt's leading token ids whose KV this decode holds (whole pages, cached
        in `namespace`: Req.cache_namespace, which the hash includes);
        dst_pages are for the pages after them. `staged` (a TP > 1 decode): the pages land in
        buffers of full wire pages (KVReceiver.landed) instead of the pool."""
        if room in self.receivers:
            raise TransferError(ErrorCode.DUPLICATE_ROOM, f"room {room}: a receiver already exists")
        endpoint = _parse_addr(bootstrap_addr)
        self.held.pop(room, None)  # its queue wait is over: the receiver speaks for it now
        n = self.pages.shape[0]
        if not dst_pages or any(not 0 <= p < n for p in dst_pages) or len(set(dst_pages)) != len(dst_pages):
            raise ValueError(f"room {room}: dst_pages must be distinct page indices in 0..{n - 1}")
        recv = KVReceiver(room, self._notify, self.release, self.pages, self.backend, list(dst_pages),
                          self._alloc_slot(), bootstrap_addr, self.compat.page_bytes if staged else 0)
        peer = self._peer(bootstrap_addr, endpoint)
        if not self._active(peer):
            peer.last_seen = time.monotonic()  # a peer idle until now gets a fresh grace period
        peer.rooms.add(room)
        self.receivers[room] = recv
        cached = list(cached_ids or ())
        peer.send(TransferInfo(room, self.engine_id, self.backend.address, list(dst_pages), recv.slot,
                               self.compat.digest(), self.compat.to_dict(), cached_tokens=len(cached),
                               cached_hash=_hash(cached, namespace) if cached else ""))
        return recv

    def decline(self, room: int, bootstrap_addr: str) -> None:
        """Tell the room's prefill that this decode computes the prompt itself (nothing to send)."""
        peer = self._peer(bootstrap_addr, _parse_addr(bootstrap_addr))
        peer.send(TransferInfo(room, self.engine_id, b"", [], 0, self.compat.digest(), self.compat.to_dict(),
                               local_prefill=True))

    def hold(self, room: int, bootstrap_addr: str) -> None:
        """The room waits in this decode's queue: its prefill hears so in every heartbeat and keeps
        it waiting (ValueError: not a host:port address)."""
        self._peer(bootstrap_addr, _parse_addr(bootstrap_addr))
        self.held[room] = bootstrap_addr
        self._next_hb = min(self._next_hb, time.monotonic() + self._beat_period())  # the first word comes soon

    def end(self, room: int, bootstrap_addr: str, reason: str, code: int, retry_after: int = 0) -> None:
        """This decode ends a room it opened no receiver for (refused, or ended in its queue): the
        prefill ends it too (an Abort), unless it ended it first. ValueError: not a host:port address."""
        self.held.pop(room, None)
        if self.ended.pop(room, None) is None:
            self._peer(bootstrap_addr, _parse_addr(bootstrap_addr)).send(Abort(room, reason, int(code), retry_after))

    def take_ended(self) -> dict[int, TransferError]:
        """Held rooms ended by their prefill (its Abort) or with it (lost, or it refused us) since the
        last call, each with why; they are held no longer."""
        out, self.ended = self.ended, {}
        return out

    def _end_held(self, room: int, err: TransferError) -> None:
        if self.held.pop(room, None) is not None:
            self.ended[room] = err

    def _active(self, peer: _Peer) -> list[int]:
        """The peer's rooms still in flight."""
        return [r for r in peer.rooms if r in self.receivers and self.receivers[r].state not in TERMINAL]

    def _alloc_slot(self) -> int:
        used = {r.slot for r in self.receivers.values()} | set(self.dead_slots)
        while True:
            slot = self._next_slot
            self._next_slot = self._next_slot % ((1 << 32) - 1) + 1
            if slot not in used:
                return slot

    def _peer(self, addr: str, endpoint: str) -> _Peer:
        peer = self.peers.get(addr)
        if peer is not None and peer.ctrl is not None and not self._active(peer) \
                and time.monotonic() - peer.last_seen > self.cfg.heartbeat_interval_s:
            peer.recheck(BootstrapQuery(self.engine_id))  # silent and idle: restarted meanwhile?
        if peer is None:
            ident = f"{self.engine_id}:boot".encode()
            peer = _Peer(addr, ControlDealer(self.zctx, endpoint, ident, self.cfg.cluster_token,
                                             self.dropped), time.monotonic())
            peer.boot.send(BootstrapQuery(self.engine_id))
            self.peers[addr] = peer
        return peer

    def sockets(self) -> list[zmq.Socket]:
        out = []
        for p in self.peers.values():
            out.append(p.boot.sock)
            if p.ctrl is not None:
                out.append(p.ctrl.sock)
        return out

    # ---- messages --------------------------------------------------------------------------
    def handle_messages(self) -> None:
        for peer in list(self.peers.values()):
            for msg, ok in peer.boot.recv_all():
                self._on_boot(peer, msg, ok)
            if peer.ctrl is None:
                continue
            for msg, ok in peer.ctrl.recv_all():
                if not ok:
                    self.dropped.add("unauthorized", f"{type(msg).__name__} from {peer.addr}")
                    continue
                peer.last_seen = time.monotonic()
                self._dispatch(peer, msg)

    def _on_boot(self, peer: _Peer, msg: Any, ok: bool) -> None:
        if isinstance(msg, Abort) and (ok or msg.code == ErrorCode.UNAUTHORIZED):
            # the bootstrap server refused us (a refusal for a wrong token carries the server's token)
            self._fail_peer(peer, ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_
                            else ErrorCode.ABORTED, f"prefill {peer.addr}: {msg.reason}")
            return
        if not ok:
            self.dropped.add("unauthorized", f"{type(msg).__name__} from {peer.addr}'s bootstrap server")
            return
        if not isinstance(msg, PrefillRegistration):
            self.dropped.add("unexpected", f"{type(msg).__name__} from {peer.addr}'s bootstrap server")
            return
        if peer.ctrl is not None:
            return
        peer.last_seen = time.monotonic()
        old = peer.parked
        peer.parked = None
        if old is not None and old.endpoint == msg.control_endpoint and peer.engine_id == msg.engine_id:
            peer.ctrl = old  # the same process answered: keep its connection
        else:
            if old is not None:
                log.info("prefill %s restarted (engine %s -> %s): reconnecting", peer.addr, peer.engine_id,
                         msg.engine_id)
                old.close()
            peer.ctrl = ControlDealer(self.zctx, msg.control_endpoint, self.engine_id.encode(),
                                      self.cfg.cluster_token, self.dropped)
        peer.engine_id = msg.engine_id
        for pending in peer.pending:
            peer.ctrl.send(pending)
        peer.pending.clear()

    def _dispatch(self, peer: _Peer, msg: Any) -> None:
        recv = self.receivers.get(getattr(msg, "room", -1))
        if recv is not None and recv.bootstrap_addr != peer.addr:
            return
        if isinstance(msg, TransferStatus) and recv is not None:
            if msg.state == KVPoll.WAITING_FOR_INPUT:
                recv.on_ack()
        elif isinstance(msg, ChunkManifest) and not _valid_segments(msg.segments):
            self.dropped.add("undecodable", f"ChunkManifest of room {msg.room}: segments not [[seq, [pos]]]")
        elif isinstance(msg, ChunkManifest) and recv is not None:
            recv.on_manifest(msg.segments, msg.total_pages, msg.is_last, msg.metadata)
        elif isinstance(msg, Abort):
            peer.send(AbortAck(msg.room))
            code = ErrorCode(msg.code) if msg.code in ErrorCode._value2member_map_ else ErrorCode.ABORTED
            if recv is not None:
                recv.fail(code, f"aborted by prefill: {msg.reason}", peer_fault=True)
            elif self.held.get(msg.room) == peer.addr:
                self._end_held(msg.room, TransferError(code, f"room {msg.room}: aborted by prefill: {msg.reason}",
                                                       peer_fault=True))
        elif isinstance(msg, BootstrapQuery | TransferInfo | PrefillRegistration):
            self.dropped.add("unexpected", f"{type(msg).__name__} from {peer.addr}")

    def _notify(self, room: int, reason: str, code: ErrorCode) -> None:
        recv = self.receivers.get(room)
        peer = self.peers.get(recv.bootstrap_addr) if recv is not None else None
        if peer is None:
            return
        if peer.ctrl is None:  # TransferInfo never left: take it back instead of aborting
            peer.pending = [m for m in peer.pending if getattr(m, "room", None) != room]
        else:
            peer.send(Abort(room, reason, int(code)))

    # ---- data + timers ---------------------------------------------------------------------
    def step(self) -> None:
        for recv in self.receivers.values():
            if recv.step():
                peer = self.peers.get(recv.bootstrap_addr)
                if peer is not None:
                    peer.send(TransferStatus(recv.room, int(KVPoll.SUCCESS)))
            if recv.state == KVPoll.FAILED:
                self.draining.extend(recv.drain())
                self.dead_slots.setdefault(recv.slot, time.monotonic() + SLOT_QUARANTINE_S)
        self.draining = [h for h in self.draining if not h.done]

    def check_timers(self, now: float) -> None:
        cfg = self.cfg
        for recv in self.receivers.values():
            if recv.state not in TERMINAL and now - recv.created_at > cfg.waiting_timeout_s:
                recv.fail(ErrorCode.TIMEOUT, f"KV not complete within {cfg.waiting_timeout_s}s "
                          f"(state {recv.state.name})", tell_peer=True, peer_fault=True)
        beat = now >= self._next_hb
        queued = self._held_by_peer() if beat else {}
        for peer in list(self.peers.values()):
            active = self._active(peer)
            if active and now - peer.last_seen > cfg.peer_lost_s:
                self._fail_peer(peer, ErrorCode.PEER_LOST, f"prefill {peer.addr} missed 3 heartbeats "
                                f"({cfg.peer_lost_s:g}s)", peer_fault=True)
            elif beat and (active or peer.addr in queued) and peer.ctrl is not None:
                peer.hb_seq += 1
                peer.ctrl.send(Heartbeat(self.engine_id, peer.hb_seq, sorted(active + queued.get(peer.addr, []))))
        if beat:
            self._next_hb = now + self._beat_period()
        if now >= self._next_sweep and self.dead_slots:
            self._next_sweep = now + SWEEP_INTERVAL_S
            for slot, until in list(self.dead_slots.items()):
                if self.backend.drop_slot(slot):
                    log.info("dropped late UCX data of slot %d", slot)
                if now > until:
                    del self.dead_slots[slot]

    def _beat_period(self) -> float:
        """Seconds between heartbeats: a held room's prefill times it out bootstrap_timeout_s after our last
        word, so while rooms are held we speak at least 3 times as often."""
        cfg = self.cfg
        return min(cfg.heartbeat_interval_s, cfg.bootstrap_timeout_s / 3) if self.held else cfg.heartbeat_interval_s

    def _held_by_peer(self) -> dict[str, list[int]]:
        """The held rooms by their prefill's bootstrap address."""
        out: dict[str, list[int]] = {}
        for room, addr in self.held.items():
            out.setdefault(addr, []).append(room)
        return out

    def _fail_peer(self, peer: _Peer, code: ErrorCode, message: str, peer_fault: bool = False) -> None:
        for room in peer.rooms:
            recv = self.receivers.get(room)
            if recv is not None:
                recv.fail(code, message, peer_fault=peer_fault)
        for room in [r for r, addr in self.held.items() if addr == peer.addr]:
            self._end_held(room, TransferError(code, f"room {room}: {message}", peer_fault))
        peer.close()
        self.peers.pop(peer.addr, None)

    def release(self, room: int) -> None:
        recv = self.receivers.pop(room, None)
        if recv is None:
            return
        self.draining.extend(recv.drain())
        if recv.state == KVPoll.FAILED:
            self.dead_slots.setdefault(recv.slot, time.monotonic() + SLOT_QUARANTINE_S)
        peer = self.peers.get(recv.bootstrap_addr)
        if peer is not None:
            peer.rooms.discard(room)

    def stats(self) -> LinkStats:
        return LinkStats(receivers=len(self.receivers),
                         pending_recvs=sum(r.pending() for r in self.receivers.values()),
                         staging_bytes=sum(r.staging_bytes() for r in self.receivers.values()),
                         draining=len(self.draining), peers=len(self.peers),
                         control_dropped=dict(self.dropped.counts))

    def close(self) -> None:
        for peer in self.peers.values():
            peer.close()
        self.peers.clear()
