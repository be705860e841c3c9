"""The KV cache event publisher of a worker (docs/kv_events.md): vLLM's ZmqEventPublisher, on the wire.

`start(cfg, kv)` (None when --kv-events-endpoint is empty or the worker has no prefix cache) attaches a
KVEventRecorder (engine/kvcache/events) to the worker's prefix cache and starts one thread that:
  1. takes the queued events (the scheduler only appends them: engine.kvcache.events.recorder),
  2. sends each batch as a multipart message (topic, 8-byte big-endian sequence, msgpack KVEventBatch)
     on a PUB socket, keeping the last `buffer_batches` (sequence, payload) for replay,
  3. answers replay requests on a ROUTER socket: a client sends an 8-byte big-endian start sequence and
     gets every buffered (sequence, payload) from there, then (-1, b"") as the end marker.
Sockets as vLLM makes them: the PUB endpoint binds when it holds `*`, `::`, or is ipc:// or inproc://,
and connects otherwise; the replay endpoint always binds. `info()` gives /server_info the addresses a
subscriber connects to.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any

import msgpack
import zmq

from engine.kvcache.events import BlockStored, KVEvent, KVEventRecorder
from engine.kvcache.kv_manager import KVManager
from service.config import ServerConfig

log = logging.getLogger("pdserve.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ENCODINGS = ("array", "map")


def event_wire(e: KVEvent, encoding: str = "array") -> list | dict:
    """One event as msgspec encodes vLLM's tagged struct: "array" (array_like: [tag, fields...], trailing
    defaults omitted) or "map" (vLLM >= #42892: {"type": tag, field: value, ...}, defaults omitted)."""
    tag = type(e).__name__
    fields = e._asdict()
    if isinstance(e, BlockStored) and e.extra_keys is None:
        del fields["extra_keys"]  # omit_defaults: a default-valued field is left out
    if encoding == "map":
        return {"type": tag, **fields}
    return [tag, *fields.values()]


def encode_batch(ts: float, events: list[KVEvent], dp_rank: int | None = 0, encoding: str = "array") -> bytes:
    """A KVEventBatch payload: the array [ts, events, data_parallel_rank] (positional in every vLLM)."""
    return msgpack.packb([ts, [event_wire(e, encoding) for e in events], dp_rank])


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def advertised(endpoint: str, host: str) -> str:
    """A bound endpoint as a peer reaches it: a wildcard address (0.0.0.0, [::]) becomes `host`."""
    for wild in ("0.0.0.0", "[::]", "*"):
        endpoint = endpoint.replace(f"//{wild}:", f"//{host}:")
    return endpoint


class ZmqEventPublisher:
    """Publishes a recorder's events (one thread owns both sockets); `close` flushes what is queued."""

    def __init__(self, recorder: KVEventRecorder, endpoint: str, replay_endpoint: str = "", topic: str = "",
                 encoding: str = "array", buffer_batches: int = 10_000, max_batch: int = 1024,
                 hwm: int = 100_000) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding must be one of {ENCODINGS}, got {encoding!r}")
        self.recorder, self.topic, self.encoding, self.max_batch = recorder, topic.encode(), encoding, max_batch
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)  # the last (seq, payload) sent
        self.seq = 0  # the next batch's sequence number
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.linger = 0
        if _binds(endpoint):
            self._pub.bind(endpoint)
            endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        else:
            self._pub.connect(endpoint)
        self.endpoint, self.replay_endpoint = endpoint, ""
        self._replay: zmq.Socket | None = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.linger = 0
            self._replay.bind(replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def info(self, host: str) -> dict[str, Any]:
        """/server_info: where to subscribe (and replay), the topic, the encoding and the block size."""
        return {"kv_events": {"endpoint": advertised(self.endpoint, host),
                              "replay_endpoint": advertised(self.replay_endpoint, host) or None,
                              "topic": self.topic.decode(), "encoding": self.encoding,
                              "block_size": self.recorder.page_size}}

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._ctx.destroy(linger=0)

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                self._serve_replays()
            events = self.recorder.take(self.max_batch, 0.05)
            if events:
                self._send(events)
            elif self._stop.is_set():
                return

    def _send(self, events: list[KVEvent]) -> None:
        seq, payload = self.seq, encode_batch(time.time(), events, 0, self.encoding)
        self.seq += 1
        self._pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((seq, payload))

    def _serve_replays(self) -> None:
        """Answer each waiting replay request: [id, b"", start] (a REQ client) or [id, start] (DEALER)."""
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) not in (2, 3) or len(frames[-1]) != 8:
                log.warning("ignored a malformed kv events replay request (%d frames)", len(frames))
                continue
            head, start = frames[:-1], int.from_bytes(frames[-1], "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    self._replay.send_multipart((*head, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((*head, END_SEQ, b""))


def start(cfg: ServerConfig, kv: KVManager) -> ZmqEventPublisher | None:
    """The worker's publisher over its prefix cache (None: --kv-events-endpoint unset, or no prefix cache)."""
    if not cfg.kv_events_endpoint:
        return None
    if kv.cache is None:
        log.warning("--kv-events-endpoint is set but this worker has no prefix cache: no KV events")
        return None
    recorder = KVEventRecorder(kv.page_size, cfg.kv_events_queue_size)
    kv.cache.events = recorder
    pub = ZmqEventPublisher(recorder, cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint, cfg.kv_events_topic,
                            cfg.kv_events_encoding)
    log.info("publishing KV cache events on %s (replay: %s)", pub.endpoint, pub.replay_endpoint or "off")
    return pub
