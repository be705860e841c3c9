"""KV cache events (docs/kv_events.md): what the radix tree stores and removes, as vLLM reports it.

hashing.py   the chained 64-bit block hash of a page (`block_hashes`: a request's hashes, for a router)
recorder.py  `KVEventRecorder`: the tree's hooks turn changes into BlockStored / BlockRemoved /
             AllBlocksCleared events on a bounded queue that never blocks the scheduler

The publisher that batches, encodes (msgpack) and sends them over ZeroMQ is the service's
(service/kv_events.py): the engine speaks no zmq or msgpack.
"""

from engine.kvcache.events.hashing import block_hashes, page_hash, root_hash
from engine.kvcache.events.recorder import (
    CPU,
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventRecorder,
)

__all__ = ["CPU", "GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventRecorder",
           "block_hashes", "page_hash", "root_hash"]
