"""The radix tree's side of KV cache events: tree changes in, events on a bounded queue out.

The tree (engine/kvcache/radix_cache.py, engine/kvcache/hicache/tree.py) calls `stored(nodes, medium)`
when nodes gain a page on a medium, `removed(nodes, medium)` when they lose it and `cleared()` when it
is empty after a flush. The recorder runs on the scheduler's thread and never blocks it: each event
goes on a bounded queue, and one that does not fit is dropped and counted (`dropped`; a consumer's
index then misses it: size the queue so that it never fills). The service's publisher thread takes
them (`take`), batches, encodes and sends them (service/kv_events.py).

Events are vLLM's (vllm/distributed/kv_events.py), field for field. A BlockStored names one chain of
pages (each the next one's parent): `parent_block_hash` is the hash of the chain's parent page, None
when it is the tree's root; `token_ids` are the chain's pages' ids, `block_size` ids per hash. Hashes
are engine.kvcache.events.hashing's, memoized on the node (`Node.block_hash`) when first stored, so a
removal names exactly what was stored. Media: "GPU" for the device tier (whatever the device: vLLM's
name for the primary tier), "CPU" for the host tier; the disk tier is not reported.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable
from typing import NamedTuple

from engine.kvcache.events.hashing import page_hash, root_hash
from engine.kvcache.radix_cache import CPU, GPU, Node

__all__ = ["CPU", "GPU", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent", "KVEventRecorder"]
NS_SEP = "\x1f"  # engine.request.Req.cache_namespace: "<lora>\x1f<cache salt>"


class BlockStored(NamedTuple):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # vLLM: deprecated in favour of lora_name; always None here
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None  # per block: (namespace,) on a namespace's first page


class BlockRemoved(NamedTuple):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(NamedTuple):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _is_root(node: Node) -> bool:
    return node.parent is None


def _tokens(key: tuple) -> list[int]:
    """A radix key's token ids (a namespace's first page's key starts with the namespace)."""
    return list(key[1:]) if key and isinstance(key[0], str) else list(key)


def namespace_of(node: Node) -> str:
    """The namespace of the prefix `node` ends (an attached node: walks to its first page)."""
    while node.parent is not None and not _is_root(node.parent):
        node = node.parent
    key = node.key
    return key[0] if key and isinstance(key[0], str) else ""


def lora_name_of(namespace: str) -> str | None:
    lora = namespace.split(NS_SEP, 1)[0] if NS_SEP in namespace else ""
    return lora or None


def chains(nodes: Iterable[Node]) -> list[list[Node]]:
    """`nodes` (each after its parent, when both are given) cut into runs where each is the next's parent."""
    out: list[list[Node]] = []
    for n in nodes:
        if out and n.parent is out[-1][-1]:
            out[-1].append(n)
        else:
            out.append([n])
    return out


class KVEventRecorder:
    """Events of one tree, queued for the publisher; `max_events` bounds the queue (drops counted)."""

    def __init__(self, page_size: int, max_events: int = 100_000) -> None:
        self.page_size = page_size
        self.queue: queue.Queue[KVEvent] = queue.Queue(max_events)
        self.dropped = 0  # events that found the queue full (counter: pdserve_worker_kv_events_dropped_total)

    # ---- hooks (the scheduler's thread) ---------------------------------------------------------
    def stored(self, nodes: Iterable[Node], medium: str) -> None:
        """`nodes` (attached, in path order) now hold a page on `medium`."""
        for chain in chains(nodes):
            self._put(self._stored_event(chain, medium))

    def removed(self, nodes: Iterable[Node], medium: str) -> None:
        """`nodes` no longer hold a page on `medium` (those never reported stored are skipped)."""
        hashes = [n.block_hash for n in nodes if n.block_hash is not None]
        if hashes:
            self._put(BlockRemoved(hashes, medium))

    def cleared(self) -> None:
        """The tree holds nothing any more, on any medium."""
        self._put(AllBlocksCleared())

    def node_hash(self, node: Node) -> int:
        """The block hash of an attached node's page (memoized on the path, root to node)."""
        path = []
        while not _is_root(node) and node.block_hash is None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        h = 0 if _is_root(node) else node.block_hash
        for n in reversed(path):
            parent = root_hash(n.key[0] if n.key and isinstance(n.key[0], str) else "") if _is_root(n.parent) else h
            h = n.block_hash = page_hash(parent, _tokens(n.key))  # type: ignore[arg-type]
        return h  # type: ignore[return-value]

    def _stored_event(self, chain: list[Node], medium: str) -> BlockStored:
        parent = chain[0].parent
        assert parent is not None, "a stored node is attached"
        ns = namespace_of(chain[0])
        hashes = [self.node_hash(n) for n in chain]
        ids = [t for n in chain for t in _tokens(n.key)]
        extra = None
        if ns:
            extra = [(ns,) if _is_root(n.parent) else None for n in chain]  # type: ignore[arg-type]
        return BlockStored(hashes, None if _is_root(parent) else self.node_hash(parent), ids, self.page_size,
                           None, medium, lora_name_of(ns), extra)

    def _put(self, event: KVEvent) -> None:
        try:
            self.queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    # ---- the publisher's thread -----------------------------------------------------------------
    def take(self, max_events: int, timeout: float) -> list[KVEvent]:
        """Up to `max_events` queued events, waiting up to `timeout` seconds for the first ([]: none)."""
        try:
            out = [self.queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        while len(out) < max_events:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                break
        return out
