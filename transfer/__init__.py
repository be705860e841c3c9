"""KV transfer between a prefill and a decode worker: zmq control plane, UCX data plane.

API (one TransferManager per worker process; the worker loop calls progress() every iteration):

    mgr = TransferManager(TransferConfig(role="prefill"), kv_pool, compat)   # mgr.bootstrap_port
    s = mgr.create_sender(room, prompt_ids); s.poll(); s.reused_pages; s.send(pages, is_last, metadata)
    s.abort(r); s.release()
    mgr = TransferManager(TransferConfig(role="decode"), kv_pool, compat)
    r = mgr.create_receiver(room, "host:port", dst_pages, cached_ids); r.poll(); r.metadata; r.release()
    mgr.hold_room(room, "host:port")   # queued for KV memory: its prefill keeps the room waiting
    mgr.end_room(room, "host:port", reason, code); mgr.ended_rooms()   # a held room ended by either side
    with mgr.background(): run_forward()   # the progress thread moves bytes/acks/heartbeats meanwhile

State per room, ordered so min() over ranks/rooms is the consensus:
FAILED=0 < BOOTSTRAPPING=1 < WAITING_FOR_INPUT=2 < TRANSFERRING=3 < SUCCESS=4.

    sender   BOOTSTRAPPING --TransferInfo--> WAITING_FOR_INPUT --send()--> TRANSFERRING
             --all sends done + decode's SUCCESS ack--> SUCCESS
    receiver BOOTSTRAPPING --TransferInfo acked--> WAITING_FOR_INPUT --first manifest-->
             TRANSFERRING --all pages + metadata in place--> SUCCESS
    any      --timeout / abort (local or peer) / peer lost / UCX error / bad input--> FAILED

FAILED carries `.error` (TransferError: HTTP-like `.code`, `.message` naming the room); a room frees
its queued chunks and staging buffers on reaching FAILED or SUCCESS and its bookkeeping on
release(). active_rooms() counts rooms not yet released.

Message flow (transfer/messages.py, msgpack with `version`, cluster token on every message):

    decode                                   prefill
    BootstrapQuery  ---- bootstrap server (advertise_host:bootstrap_port, zmq ROUTER) ---->
                    <--- PrefillRegistration (control endpoint, UCX worker address) -------
    TransferInfo    ---- control endpoint (zmq ROUTER, free port) ------------------------>
      (room, decode UCX address, dst pages, metadata slot, compat hash + fields,
       cached_tokens + cached_hash: the prompt prefix the decode holds; dst pages start after it)
                    <--- TransferStatus(WAITING_FOR_INPUT) | Abort(reason, code) ----------
      (Abort(PREFIX_MISMATCH): the prefix is not this prompt's; the room stays open and the
       decode sends a second TransferInfo with cached_tokens 0 and pages for the whole prompt)
                    <=== UCX tagged messages, tag = (slot << 32) | seq ====================
                    <--- ChunkManifest(room, [[seq, dst positions]], total, is_last, meta) -
    TransferStatus(SUCCESS) ------------------------------------------------------------->
    Heartbeat (every interval while rooms are active or held) <-> Heartbeat reply
      (lists the decode's rooms with that prefill; one still BOOTSTRAPPING there waits in the
       decode's queue: its bootstrap timer counts from that heartbeat)
    Abort <-> AbortAck (either direction)

KV layout: kv_pool [num_pages, num_layers, 2, page_size, num_kv_heads, head_dim], page-major, so a
page is `page_bytes` contiguous bytes and consecutive pages are one region. Chunks map onto the
decode's dst_pages by position (a cursor). Runs consecutive on both sides and >= 256 KiB go as one
zero-copy message; short runs are gathered into one staging message (<= 8 MiB) and scattered on
arrival, or received in place when their destination pages happen to be consecutive
(transfer/layout.py). The receiver never pre-posts receives: it probes for the tags a manifest
announced, so a failed room's late bytes never land in pages it gave back. CUDA pools move
device-to-device with no host staging (the sender waits on a CUDA event recorded after the chunk).

Unequal TP: the wire page always holds all KV heads (CompatInfo; its `tp` is servable, not hashed).
A TP > 1 prefill passes each chunk's gathered full pages, `s.send(pages, is_last, meta, data=uint8
[n, wire page_bytes])`; a TP > 1 decode opens `create_receiver(..., staged=True)` and scatters each
landed message to its ranks, `for pages, buf in r.landed(): ...` (engine/distributed/tp_kv.py).

Backends: "ucx" (ucxx low-level API, explicit progress, worker-address endpoints, error handling
off: shared memory on one host, TCP across hosts; transfer/ucx_backend.py lists the UCX_* settings)
and "fake" (same state machine and control plane, no bytes; unit tests and scheduler benchmarks).
"""

from transfer.config import CompatInfo, TransferConfig
from transfer.manager import TransferManager
from transfer.rooms import KVReceiver, KVSender
from transfer.state import ErrorCode, KVPoll, TransferError

__all__ = [
    "CompatInfo",
    "ErrorCode",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "TransferConfig",
    "TransferError",
    "TransferManager",
]
