"""zmq control-plane sockets that own serialization and the cluster-token check.

ControlRouter  binds (prefill: bootstrap server and control endpoint); replies by peer identity.
ControlDealer  connects (decode: one to each prefill's bootstrap server and control endpoint).

Both stamp the configured cluster token on every message they send and mark every message they
receive as authorized or not (constant-time compare). A frame that does not decode (random bytes,
truncated msgpack, an ill-typed field), has another message version or comes with the wrong
number of frames is dropped and counted in the side's `Dropped` (the sides count what they refuse
after decoding: a wrong cluster token, a message the socket does not take). A frame over
MAX_FRAME_BYTES closes the sender's connection inside libzmq. All sockets have LINGER 0, so
close() never waits for an unreachable peer.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any

import zmq

import transfer.messages as messages
from common.codec import VersionError

log = logging.getLogger(__name__)
MAX_FRAME_BYTES = 64 << 20  # a TransferInfo for a million pages is ~5 MB


class Dropped:
    """Control messages dropped, by reason; exported as transfer stats `control_dropped{reason}`.

    undecodable: not a message (random bytes, truncated msgpack, unknown type, bad field);
    version: a message of another protocol version; frames: a multipart of the wrong shape;
    unauthorized: missing or wrong cluster token; unexpected: a type this socket does not take."""

    REASONS = ("undecodable", "version", "frames", "unauthorized", "unexpected")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.REASONS, 0)

    def add(self, reason: str, what: str) -> None:
        self.counts[reason] += 1
        log.warning("dropped control message (%s): %s", reason, what)


def bind_host(advertise_host: str) -> str:
    """Bind where peers reach us when that is an IP literal, else on every interface."""
    try:
        ipaddress.ip_address(advertise_host)
    except ValueError:
        return "*"
    return advertise_host


def _authorized(msg: Any, token: str | None) -> bool:
    if token is None:
        return True
    got = getattr(msg, "token", None)
    return isinstance(got, str) and hmac.compare_digest(got.encode(), token.encode())


def _decode(frame: bytes, dropped: Dropped) -> Any | None:
    try:
        return messages.decode(frame)
    except VersionError as e:
        dropped.add("version", str(e))
    except ValueError as e:
        dropped.add("undecodable", str(e)[:200])
    return None


def _socket(zctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = zctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    return sock


class _ControlSocket:
    """What both ends share: the socket, the cluster token stamped and checked, the drop counter."""

    def __init__(self, zctx: zmq.Context, kind: int, token: str | None, dropped: Dropped) -> None:
        self.sock = _socket(zctx, kind)
        self.dropped = dropped
        self._token = token

    def _drain(self, head: int) -> list[tuple[list[bytes], Any, bool]]:
        """Every message waiting, without blocking: [(the `head` frames before it, message, authorized)].
        head: the routing frames a message comes after (a ROUTER's peer identity: 1; a DEALER: 0)."""
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != head + 1:
                self.dropped.add("frames", f"{len(frames) - head} frames" + (" after the identity" if head else ""))
                continue
            msg = _decode(frames[head], self.dropped)
            if msg is not None:
                out.append((frames[:head], msg, _authorized(msg, self._token)))

    def close(self) -> None:
        self.sock.close()


class ControlRouter(_ControlSocket):
    def __init__(self, zctx: zmq.Context, advertise_host: str, port: int, token: str | None,
                 dropped: Dropped) -> None:
        super().__init__(zctx, zmq.ROUTER, token, dropped)
        host = bind_host(advertise_host)
        try:
            if port == 0:
                self.port = self.sock.bind_to_random_port(f"tcp://{host}")
            else:
                self.sock.bind(f"tcp://{host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self.sock.close()
            raise ValueError(f"cannot bind tcp://{host}:{port}: {e}") from e
        self.endpoint = f"tcp://{advertise_host}:{self.port}"

    def send(self, identity: bytes, msg: Any) -> None:
        msg.token = self._token
        self.sock.send_multipart([identity, messages.encode(msg)], zmq.NOBLOCK)

    def recv_all(self) -> list[tuple[bytes, Any, bool]]:
        """Drain without blocking: [(peer identity, message, authorized)]."""
        return [(head[0], msg, ok) for head, msg, ok in self._drain(1)]


class ControlDealer(_ControlSocket):
    def __init__(self, zctx: zmq.Context, endpoint: str, identity: bytes, token: str | None,
                 dropped: Dropped) -> None:
        super().__init__(zctx, zmq.DEALER, token, dropped)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def send(self, msg: Any) -> None:
        msg.token = self._token
        try:
            self.sock.send(messages.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # high-water mark reached: the peer is gone or stuck; heartbeats decide
            log.warning("control queue to %s full, dropped %s", self.endpoint, type(msg).__name__)

    def recv_all(self) -> list[tuple[Any, bool]]:
        """Drain without blocking: [(message, authorized)]."""
        return [(msg, ok) for _, msg, ok in self._drain(0)]
