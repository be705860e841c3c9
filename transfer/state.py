"""Transfer state shared by senders and receivers: the ordered poll state and the error object.

KVPoll is ordered so that min() over ranks or rooms gives the consensus state:
FAILED=0 < BOOTSTRAPPING=1 < WAITING_FOR_INPUT=2 < TRANSFERRING=3 < SUCCESS=4.
Failures are reported as a TransferError object on the room (`.error`), not raised from poll().
TransferError is also raised for caller mistakes that cannot be queued (duplicate room).
"""

from __future__ import annotations

from enum import IntEnum


class KVPoll(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


class ErrorCode(IntEnum):
    """HTTP-like codes, so a service can copy them into TokenOut.error_code."""

    BAD_REQUEST = 400  # invalid pages, page count mismatch, bad metadata
    UNAUTHORIZED = 401  # cluster token missing or wrong
    TIMEOUT = 408  # bootstrap or waiting timeout
    DUPLICATE_ROOM = 409  # a second sender/receiver/TransferInfo for one room
    INCOMPATIBLE = 412  # compatibility hash mismatch (field named in the message)
    PREFIX_MISMATCH = 428  # the decode's cached prefix is not this prompt's: it asks again, whole
    ABORTED = 499  # aborted locally or by the peer
    TRANSPORT = 500  # UCX error on a send or receive
    PEER_LOST = 503  # peer missed 3 heartbeats


class TransferError(Exception):
    """Why a room failed: a code and a human-readable message naming the room. `peer_fault` is True
    when the other side caused it (it went silent, it timed out, it aborted the room), so a service
    can tell its router which worker to blame."""

    def __init__(self, code: ErrorCode, message: str, peer_fault: bool = False, retry_after: int = 0) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message
        self.peer_fault = peer_fault
        self.retry_after = retry_after  # the peer refused the room as overloaded: seconds to wait (Abort)

    def __repr__(self) -> str:
        return f"TransferError({self.code.name}, {self.message!r})"


TERMINAL = (KVPoll.FAILED, KVPoll.SUCCESS)
