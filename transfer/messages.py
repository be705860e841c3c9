"""Typed control-plane messages of the KV transfer protocol (zmq + msgpack).

Every message is a small dataclass; on the wire it is a msgpack map with `type` and `version`.
`encode`/`decode` are common.codec's one codec; an unknown type, a version mismatch or a missing
field raises ValueError, never a half-read message. Every message carries the sender's cluster `token`
(None when no token is configured); the receiving side checks it.

decode -> prefill bootstrap server:  BootstrapQuery
prefill bootstrap server -> decode:  PrefillRegistration (control endpoint + UCX worker address)
decode -> prefill control endpoint:  TransferInfo, TransferStatus(SUCCESS ack), Abort, AbortAck, Heartbeat
prefill -> decode:                   TransferStatus(WAITING_FOR_INPUT ack), ChunkManifest, Abort,
                                     AbortAck, Heartbeat
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass, field
from typing import Any

from common.codec import Codec

VERSION = 4  # 2: TransferInfo.local_prefill; 3: TransferInfo.cached_tokens/cached_hash; 4: Abort.retry_after


@dataclass
class BootstrapQuery:
    """A decode asks a bootstrap server where the prefill's control endpoint is."""

    engine_id: str
    token: str | None = None
    version: int = VERSION


@dataclass
class PrefillRegistration:
    """Where a prefill worker listens: zmq control endpoint ("tcp://host:port") and UCX address."""

    engine_id: str
    control_endpoint: str
    ucx_address: bytes
    token: str | None = None
    version: int = VERSION


@dataclass
class TransferInfo:
    """A decode reserved `dst_pages` for `room` and asks the prefill to stream its KV there.

    metadata_slot: decode-local slot id of this room; UCX tags of its data are (slot << 32) | seq.
    compat_hash / compat: CompatInfo digest and fields (the fields name a mismatch).
    local_prefill: the decode computes this prompt itself (conditional disaggregation): nothing is
    sent; the prefill ends the room without computing it (dst_pages empty, metadata_slot 0).
    cached_tokens / cached_hash (decode-side prefix reuse): the decode already holds the KV of the
    prompt's first `cached_tokens` tokens (a whole number of pages, never the last prompt token) and
    `cached_hash` = prefix_hash(those token ids). dst_pages then cover only the pages after them:
    dst position 0 is prompt page cached_tokens // page_size. A prefill whose own prompt does not
    hash the same refuses the TransferInfo with Abort(PREFIX_MISMATCH) and keeps the room waiting
    for another; the decode sends one again with cached_tokens 0 and pages for the whole prompt.
    """

    room: int
    engine_id: str
    ucx_address: bytes
    dst_pages: list[int]
    metadata_slot: int
    compat_hash: str
    compat: dict[str, Any]
    token: str | None = None
    local_prefill: bool = False
    cached_tokens: int = 0
    cached_hash: str = ""
    version: int = VERSION


def prefix_hash(ids: list[int], namespace: str = "") -> str:
    """The digest both sides compute over a prompt prefix's token ids and its request's
    cache namespace (TransferInfo.cached_hash; Req.cache_namespace, "" for none)."""
    h = hashlib.blake2b(array("q", ids).tobytes(), digest_size=16)
    if namespace:
        h.update(b"\0" + namespace.encode())
    return h.hexdigest()


@dataclass
class TransferStatus:
    """State report for a room: WAITING_FOR_INPUT (TransferInfo accepted) or SUCCESS (all bytes in)."""

    room: int
    state: int
    message: str = ""
    token: str | None = None
    version: int = VERSION


@dataclass
class ChunkManifest:
    """One prefill chunk: which UCX messages were sent and where their pages go.

    segments: [[seq, [dst positions...]], ...]; a position indexes the room's dst_pages; message
    `seq` holds those pages' bytes back to back, in position order. total_pages: cursor after
    this chunk. metadata only with is_last.
    """

    room: int
    segments: list[list[Any]]
    total_pages: int
    is_last: bool
    metadata: dict[str, Any] | None = None
    token: str | None = None
    version: int = VERSION


@dataclass
class Abort:
    """Either side ends a room. `retry_after` > 0: an overloaded decode refused it (its queue full, its
    queue deadline passed); the prefill's answer carries the same Retry-After, so the router treats
    whichever answer comes first as the decode's refusal, never as a failure."""

    room: int
    reason: str
    code: int
    retry_after: int = 0
    token: str | None = None
    version: int = VERSION


@dataclass
class AbortAck:
    room: int
    token: str | None = None
    version: int = VERSION


@dataclass
class Heartbeat:
    engine_id: str
    seq: int = 0
    # rooms the sender holds with the receiver: a decode's in flight and those waiting in its queue for KV
    # memory (the prefill keeps a listed room that has no TransferInfo yet waiting: PrefillSide._on_queued)
    rooms: list[int] = field(default_factory=list)
    token: str | None = None
    version: int = VERSION


Message = (
    BootstrapQuery | PrefillRegistration | TransferInfo | TransferStatus | ChunkManifest | Abort
    | AbortAck | Heartbeat
)
CODEC = Codec("transfer message", BootstrapQuery, PrefillRegistration, TransferInfo, TransferStatus,
              ChunkManifest, Abort, AbortAck, Heartbeat)
encode = CODEC.encode
decode = CODEC.decode
