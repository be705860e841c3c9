"""Encoder worker (E/P/D): run a vision-language model's tower for each request's images and send the rows
to the request's prefill, page by page, over the transfer plane.

Queues of one request (a room):
  todo       its images are not encoded yet: each step encodes every waiting request's images in one tower
             call (images seen before come from the cache by content hash: engine.extras.multimodal.Encoder),
             when the row pool has room for them (else they wait, in arrival order)
  bootstrap  its rows sit in pages of the row pool (engine.extras.multimodal.RowPool); the sender waits for
             the prefill's TransferInfo (--bootstrap-timeout), then sends all pages at once, with the images'
             hashes as metadata (the prefill checks them against its own)
  inflight   waiting for the prefill's SUCCESS ack; then the pages are freed and the request reported
             finished (finish reason "length", no tokens): the router's 200 from this role
A room that fails (timeout, abort, the prefill gone) frees its pages and reports the transfer error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.extras import multimodal
from engine.models.embedded import resolve_model_path
from engine.models.loader import DTYPES, load_tower
from engine.request import FinishReason, Req
from service import messages as m
from service.channels import WorkerChannels
from service.config import ServerConfig
from service.pd import image_compat, transfer_error
from service.stats import Counters, KVStats, WorkerStats
from service.watchdog import PREFILL, SENDING_KV, WAITING_DECODE, Progress
from service.worker import error_out, req_from_msg, run_loop, setup_process, token_out
from transfer import KVPoll, KVSender, TransferError, TransferManager

log = logging.getLogger("pdserve.encoder")


@dataclass
class Room:
    req: Req
    sender: KVSender
    pages: list[int]


class EncoderRole:
    """The encoder's queues over an injected tower, row pool and transfer manager."""

    kv = None  # no language model: no KV, no prefix cache
    runner = None
    language_model = False  # the worker loop answers flush, embeddings and LoRA messages with "none here"

    def __init__(self, tower: torch.nn.Module, mc: ModelConfig, pool: multimodal.RowPool, mgr: TransferManager,
                 device: torch.device | str, dtype: torch.dtype, cache_bytes: int) -> None:
        self.mc, self.pool, self.mgr = mc, pool, mgr
        self.encoder = multimodal.Encoder(tower, device, dtype, cache_bytes)
        self.todo: list[Req] = []
        self.bootstrap: list[Room] = []
        self.inflight: list[Room] = []
        self.done: list[Req] = []
        self.sent_bytes = 0

    # ---- intake -------------------------------------------------------------------------------
    def add(self, msg: m.GenerateReq) -> list[m.TokenOut]:
        if not msg.images:
            return [error_out(msg.rid, "an encoder takes only requests with images", 400)]
        rows = sum(x.tokens for x in msg.images)
        if self.pool.pages_for(rows) > self.pool.allocator.capacity:
            return [error_out(msg.rid, f"the request's images are {rows} image tokens; this encoder's row pool holds "
                              f"{self.pool.allocator.capacity * self.pool.page_rows} (--image-transfer-tokens)", 400)]
        self.todo.append(req_from_msg(msg, "encoder"))
        return []

    def abort(self, msg: m.AbortReq) -> None:
        for r in [r for r in self.todo if r.matches(msg.rid, msg.room, msg.abort_all)]:
            self.todo.remove(r)
            self._finish(r, FinishReason.ABORT, msg.reason or "aborted", 499)
        for room in [x for x in (*self.bootstrap, *self.inflight) if x.req.matches(msg.rid, msg.room, msg.abort_all)]:
            room.sender.abort(msg.reason or "aborted")
            self._end(room, FinishReason.ABORT, msg.reason or "aborted", 499)

    def close_session(self, session_id: str) -> None:
        """No sessions here."""

    # ---- one iteration ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.done) or any(self.pool.can_hold(_rows(r)) for r in self.todo[:1])

    def wait(self, io: WorkerChannels) -> None:
        self.mgr.idle_wait(1.0, extra=(io.inbox.socket,))

    def step(self) -> list[m.TokenOut]:
        self.mgr.progress()
        self._encode()
        self._poll()
        self.mgr.progress()
        out, self.done = self.done, []
        return [token_out(r) for r in out]

    def _encode(self) -> None:
        """Encode the waiting requests whose rows fit the pool now (in arrival order), in one tower call."""
        batch: list[Req] = []
        free = self.pool.allocator.num_free
        for r in self.todo:
            need = self.pool.pages_for(_rows(r))
            if need > free:
                break
            batch.append(r)
            free -= need
        if not batch:
            return
        del self.todo[: len(batch)]
        try:
            self.encoder.encode([im for r in batch for im in r.mm.images])  # type: ignore[union-attr]
        except ValueError as e:  # pixels the tower refuses: the frontend's processor and the model disagree
            for r in batch:
                self._finish(r, FinishReason.ERROR, f"the vision tower refused the images: {e}", 400)
            return
        for r in batch:
            images = r.mm.images  # type: ignore[union-attr]
            pages = self.pool.put([im.features for im in images])  # type: ignore[misc]
            r.mm.release()  # type: ignore[union-attr]
            try:
                sender = self.mgr.create_sender(r.pd.room, r.input_ids, r.cache_namespace)
            except TransferError as e:
                self.pool.free(pages)
                self._finish(r, FinishReason.ERROR, e.message, int(e.code))
                continue
            self.bootstrap.append(Room(r, sender, pages))
            log.info("rid=%s room=%d: %d images, %d rows encoded, waiting for the prefill", r.rid, r.pd.room,
                     len(images), _rows(r))

    def _poll(self) -> None:
        for room in list(self.bootstrap):
            st = room.sender.poll()
            if st == KVPoll.FAILED:
                self._fail(room)
            elif st >= KVPoll.WAITING_FOR_INPUT:
                self.bootstrap.remove(room)
                meta = {"room": room.req.pd.room, "images": [x.hash.hex() for x in room.req.mm.images],  # type: ignore[union-attr]
                        "rows": _rows(room.req)}
                try:
                    room.sender.send(room.pages, True, meta)
                except (ValueError, TransferError) as e:
                    room.sender.abort(str(e))
                    self._end(room, FinishReason.ERROR, f"image rows send failed: {e}", 500)
                    continue
                self.inflight.append(room)
        for room in list(self.inflight):
            st = room.sender.poll()
            if st == KVPoll.SUCCESS:
                self.sent_bytes += len(room.pages) * self.mgr.wire_page_bytes
                self._end(room, FinishReason.LENGTH)
            elif st == KVPoll.FAILED:
                self._fail(room)

    def _fail(self, room: Room) -> None:
        message, code, fault = transfer_error(room.sender.error, "encoder")
        log.warning("rid=%s room=%d: %s", room.req.rid, room.req.pd.room, message)
        self._end(room, FinishReason.ERROR, message, code, fault)

    def _end(self, room: Room, reason: FinishReason, error: str | None = None, code: int = 0,
             fault: str = "") -> None:
        for q in (self.bootstrap, self.inflight):
            if room in q:
                q.remove(room)
        self.pool.free(room.pages)
        room.sender.release()
        self._finish(room.req, reason, error, code, fault)

    def _finish(self, r: Req, reason: FinishReason, error: str | None = None, code: int = 0, fault: str = "") -> None:
        r.finish(reason, error, code, fault)
        if r.mm is not None:
            r.mm.release()
        self.done.append(r)

    # ---- reporting ----------------------------------------------------------------------------
    def busy(self) -> int:
        return len(self.todo) + len(self.bootstrap) + len(self.inflight)

    def stats(self) -> WorkerStats:
        rows = self.pool.allocator.num_used * self.pool.page_rows
        return WorkerStats(
            queues={"encode": len(self.todo), "bootstrap": len(self.bootstrap), "inflight": len(self.inflight)},
            kv=KVStats(used_tokens=rows, total_tokens=self.pool.allocator.capacity * self.pool.page_rows),
            active_rooms=self.mgr.active_rooms(), link=self.mgr.stats(),
            counters=Counters(images_encoded=self.encoder.images_encoded, image_cache_hits=self.encoder.cache_hits))

    def progress(self) -> Iterable[Progress]:
        """For the watchdog: a waiting request moves with the images this worker encodes; a room with its sender."""
        for r in self.todo:
            yield Progress(r, PREFILL, self.encoder.images_encoded)
        for room in self.bootstrap:
            yield Progress(room.req, WAITING_DECODE, room.sender.moved)
        for room in self.inflight:
            yield Progress(room.req, SENDING_KV, room.sender.moved)

    def fail(self, req: Req, why: str) -> None:
        if req in self.todo:
            self.todo.remove(req)
            self._finish(req, FinishReason.ERROR, why, 503)
            return
        for room in (*self.bootstrap, *self.inflight):
            if room.req is req:
                room.sender.abort(why)
                self._end(room, FinishReason.ERROR, why, 503)
                return

    def close(self) -> None:
        for room in (*self.bootstrap, *self.inflight):
            room.sender.abort("encoder worker shutting down")
        self.mgr.close()


def _rows(r: Req) -> int:
    return sum(im.tokens for im in r.mm.images) if r.mm is not None else 0


def run_encoder_worker(cfg: ServerConfig) -> None:
    """The encoder worker process: the tower alone, a row pool and a sending transfer manager."""
    setup_process(cfg)
    eng = cfg.engine
    path = resolve_model_path(eng.model)
    mc = ModelConfig.from_dir(path)
    if mc.vision is None:
        raise ValueError(f"{path}: `pdserve encoder` runs a vision-language model's tower; {mc.model_type} has none")
    if eng.threads:
        torch.set_num_threads(eng.threads)
    dtype, device = DTYPES[eng.dtype], torch.device(eng.device)
    tower = load_tower(path, mc, eng.dtype, str(device))
    pool = multimodal.RowPool(eng.image_transfer_tokens, 1 + mc.deepstack_layers, mc.hidden_size, dtype, device)
    mgr = TransferManager(cfg.pd.transfer_config("prefill"), pool.buffer, image_compat(mc, eng.dtype, pool.page_rows))
    role = EncoderRole(tower, mc, pool, mgr, device, dtype, eng.image_cache_mb << 20)
    info = {"role": "encoder", "model_path": str(path), "model_type": mc.model_type, "hidden_size": mc.hidden_size,
            "vocab_size": mc.vocab_size, "context_length": mc.max_position, "device": eng.device, "dtype": eng.dtype,
            "image_transfer_tokens": pool.allocator.capacity * pool.page_rows, "bootstrap_port": mgr.bootstrap_port,
            "advertise_host": cfg.pd.advertise_host or "127.0.0.1"}
    run_loop(cfg, role, info)
