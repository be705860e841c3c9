"""Data-plane backends: move page bytes by tag. `transfer.manager.make_backend` picks one by name
(the UCX one, in transfer/ucx_backend.py, imports this contract; this module never imports it).

Contract (both backends):
- `send(peer, tag, buf)` posts one tagged message of buf (uint8, contiguous) to the peer worker
  whose address is `peer`; returns a Handle. buf must stay alive and unchanged until done.
- `probe(tag, nbytes)` returns a Probe when a message with exactly this tag has arrived (or its
  rendezvous header has), else None. The receiver never pre-posts receives: it probes for the tags a
  ChunkManifest announced, so a failed room's late bytes never land in pages it gave back.
- `recv(probe, buf)` receives the probed message into buf (uint8, contiguous, probe.length bytes).
- `drop_slot(slot)` receives and discards every arrived message whose tag has `slot` in its high
  32 bits (late data of a room that ended); returns how many.
- `progress()` never blocks; `wait_fd()` arms the backend for an idle wait: (may_sleep, fd or None).

FakeBackend moves no bytes between processes: sends complete at once and every probe matches with
the announced size. Between two fake backends in one process (the in-process PD tests) it hands the
bytes over, so a decode stepped next to its prefill gets the real KV. It exists for unit tests of the
queue logic and scheduler benchmarks; it is never the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

SLOT_SHIFT = 32
SEQ_MASK = (1 << SLOT_SHIFT) - 1


def make_tag(slot: int, seq: int) -> int:
    """64-bit UCX tag of message `seq` of the room holding decode slot `slot`."""
    if not (0 < slot < (1 << 32) and 0 <= seq <= SEQ_MASK):
        raise ValueError(f"tag out of range: slot={slot} seq={seq}")
    return (slot << SLOT_SHIFT) | seq


class Handle(Protocol):
    @property
    def done(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


@dataclass
class Probe:
    tag: int
    length: int
    raw: Any = None  # backend's own probe result


class DataBackend(Protocol):
    address: bytes

    def send(self, peer: bytes, tag: int, buf: torch.Tensor) -> Handle: ...

    def probe(self, tag: int, nbytes: int) -> Probe | None: ...

    def recv(self, probe: Probe, buf: torch.Tensor) -> Handle: ...

    def drop_slot(self, slot: int) -> int: ...

    def disconnect(self, peer: bytes) -> None: ...

    def progress(self) -> None: ...

    def wait_fd(self) -> tuple[bool, int | None]: ...

    def close(self) -> None: ...


class DoneHandle:
    done = True
    error: str | None = None


_IN_PROCESS: dict[bytes, FakeBackend] = {}  # address -> open fake backends of this process


class FakeBackend:
    """Same calls, no bytes: every send is done at once, every announced message has arrived.
    A peer in this process gets a copy of the bytes (its `mailbox`, by tag)."""

    def __init__(self, engine_id: str) -> None:
        self.address = f"fake:{engine_id}".encode()
        self.sent = 0  # messages "sent" (tests read it)
        self.mailbox: dict[int, torch.Tensor] = {}
        _IN_PROCESS[self.address] = self

    def send(self, peer: bytes, tag: int, buf: torch.Tensor) -> Handle:
        self.sent += 1
        local = _IN_PROCESS.get(peer)
        if local is not None:
            local.mailbox[tag] = buf.clone()
        return DoneHandle()

    def probe(self, tag: int, nbytes: int) -> Probe | None:
        return Probe(tag, nbytes, self.mailbox.pop(tag, None))

    def recv(self, probe: Probe, buf: torch.Tensor) -> Handle:
        if probe.raw is not None and probe.raw.numel() == buf.numel():
            buf.copy_(probe.raw)
        return DoneHandle()

    def drop_slot(self, slot: int) -> int:
        late = [t for t in self.mailbox if t >> SLOT_SHIFT == slot]
        for t in late:
            del self.mailbox[t]
        return len(late)

    def disconnect(self, peer: bytes) -> None:
        pass

    def progress(self) -> None:
        pass

    def wait_fd(self) -> tuple[bool, int | None]:
        return True, None

    def close(self) -> None:
        _IN_PROCESS.pop(self.address, None)

