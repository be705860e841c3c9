"""E/P/D, the prefill's side: image rows an encoder sends (encoder_service/worker.py) land here.

A request whose body named an encoder (`encoder_bootstrap_host/port`: the router picked one) carries no pixels
to this worker; `ImageRooms.expect` reserves pages of the landing RowPool for all its images' rows and opens a
receiving room on a second TransferManager (role "decode": this prefill connects to the encoder's bootstrap
server as a decode connects to a prefill). The prefill keeps the request in its bootstrap queue until the room
succeeds; `land` then checks the encoder's image hashes against the request's, copies each image's rows into
its `features` (so the batch never runs the tower for them) and frees the pages. A failed room fails the request
with fault "encoder" (the router counts it against the encoder).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.extras.multimodal import RowPool
from engine.request import Req
from engine.request_groups import Bootstrap
from service.config import ServerConfig
from service.pd import image_compat
from transfer import KVPoll, KVReceiver, TransferError, TransferManager


@dataclass
class ImageRoom:
    receiver: KVReceiver
    pages: list[int]


class ImageRooms:
    def __init__(self, pool: RowPool, mgr: TransferManager) -> None:
        self.pool, self.mgr = pool, mgr
        self.landed_bytes = 0

    @classmethod
    def for_server(cls, cfg: ServerConfig, mc: object, device: torch.device | str,
                   dtype: torch.dtype) -> ImageRooms | None:
        """The landing side of a vision-language prefill (None for a text-only model)."""
        if getattr(mc, "vision", None) is None:
            return None
        pool = RowPool(cfg.engine.image_transfer_tokens, 1 + mc.deepstack_layers, mc.hidden_size,  # type: ignore[attr-defined]
                       dtype, device)
        mgr = TransferManager(cfg.pd.transfer_config("decode"), pool.buffer,
                              image_compat(mc, cfg.engine.dtype, pool.page_rows))
        return cls(pool, mgr)

    def expect(self, r: Req, encoder: Bootstrap) -> ImageRoom | str:
        """Open the room for r's images' rows from `encoder`; a message (503: the landing pool is full now) if not."""
        assert r.mm is not None
        rows = sum(im.tokens for im in r.mm.images)
        if not self.pool.can_hold(rows):
            return (f"this prefill's image landing pool is full ({rows} rows needed, "
                    f"{self.pool.allocator.num_free * self.pool.page_rows} free; --image-transfer-tokens)")
        pages = self.pool.allocator.allocate(self.pool.pages_for(rows))
        try:
            rx = self.mgr.create_receiver(encoder.room, encoder.addr, pages)
        except (TransferError, ValueError) as e:
            self.pool.free(pages)
            return f"cannot reach the encoder at {encoder.addr}: {e}"
        return ImageRoom(rx, pages)

    def poll(self, room: ImageRoom) -> KVPoll:
        return room.receiver.poll()

    def land(self, r: Req, room: ImageRoom) -> str | None:
        """Copy the landed rows into r's images (then free the room); an error message when they are not r's."""
        assert r.mm is not None
        meta = room.receiver.metadata or {}
        want = [im.hash.hex() for im in r.mm.images]
        try:
            if meta.get("images") != want:
                return "the encoder sent rows of other images than this request's (image hashes differ)"
            feats = self.pool.take(room.pages, [im.tokens for im in r.mm.images])
            for im, f in zip(r.mm.images, feats):
                im.features = f
            self.landed_bytes += len(room.pages) * self.mgr.wire_page_bytes
            return None
        finally:
            self.close(room)

    def close(self, room: ImageRoom, reason: str = "") -> None:
        """Free the room's pages (aborting it first when `reason`)."""
        if reason:
            room.receiver.abort(reason)
        room.receiver.release()
        self.pool.free(room.pages)

    def progress(self) -> None:
        self.mgr.progress()

    def close_all(self) -> None:
        self.mgr.close()
