"""zmq control-plane sockets that own serialization and the cluster-token check.

ControlRouter  binds (prefill: bootstrap server and control endpoint); replies by peer identity.
ControlDealer  connects (decode: one to each prefill's bootstrap server and control endpoint).

Both stamp the configured cluster token on every message they send and mark every message they
receive as authorized or not (constant-time compare). Undecodable frames are logged and dropped.
All sockets have LINGER 0, so close() never waits for an unreachable peer.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any

import zmq

from transfer import messages

log = logging.getLogger(__name__)


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


def _decode(frame: bytes) -> Any | None:
    try:
        return messages.decode(frame)
    except ValueError as e:
        log.warning("dropping control message: %s", e)
        return None


class ControlRouter:
    def __init__(self, zctx: zmq.Context, advertise_host: str, port: int, token: str | None) -> None:
        self.sock = zctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
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
        self._token = token

    def send(self, identity: bytes, msg: Any) -> None:
        msg.token = self._token
        self.sock.send_multipart([identity, messages.encode(msg)], zmq.NOBLOCK)

    def recv_all(self) -> list[tuple[bytes, Any, bool]]:
        """Drain without blocking: [(peer identity, message, authorized)]."""
        out = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return out
            if len(frames) != 2:
                log.warning("dropping control message with %d frames", len(frames))
                continue
            msg = _decode(frames[1])
            if msg is not None:
                out.append((frames[0], msg, _authorized(msg, self._token)))

    def close(self) -> None:
        self.sock.close()


class ControlDealer:
    def __init__(self, zctx: zmq.Context, endpoint: str, identity: bytes, token: str | None) -> None:
        self.sock = zctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self._token = token

    def send(self, msg: Any) -> None:
        msg.token = self._token
        try:
            self.sock.send(messages.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # high-water mark reached: the peer is gone or stuck; heartbeats decide
            log.warning("control queue to %s full, dropped %s", self.endpoint, type(msg).__name__)

    def recv_all(self) -> list[tuple[Any, bool]]:
        out = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            msg = _decode(frame)
            if msg is not None:
                out.append((msg, _authorized(msg, self._token)))

    def close(self) -> None:
        self.sock.close()
