"""Block hashes of KV cache events (docs/kv_events.md): one unsigned 64-bit hash per full page, chained.

    H(b)        = the first 8 bytes of sha256(b), read as a big-endian unsigned integer
    root(ns)    = H(b"pdserve-kv-root\\0" + utf8(ns))
    hash_0      = H(be64(root(ns)) + be32(t) for each token id t of page 0)
    hash_i      = H(be64(hash_{i-1}) + be32(t) for each token id t of page i)

`ns` is the request's prefix-cache namespace (engine.request.Req.cache_namespace: its LoRA adapter and
cache salt; "" when it has neither), so the same tokens under another adapter or salt hash apart, as the
tree keeps them apart. A page is `page_size` token ids; the partial last page of a sequence has no hash
(the tree never caches it). Deterministic across processes and machines (no Python `hash`). The worker's
event recorder (engine/kvcache/events) and the router's index (router/kv_index.py) both hash with this
module, which is why it lives in common/ (hashlib and struct only).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from functools import lru_cache

ROOT_TAG = b"pdserve-kv-root\0"
NS_SEP = "\x1f"  # engine.request.Req.cache_namespace: "<lora>\x1f<cache salt>"


def _h(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


@lru_cache(maxsize=4096)
def root_hash(namespace: str) -> int:
    """The parent hash of a namespace's first page (never itself a block's hash on the wire: a first
    page's BlockStored says parent None, as vLLM's does)."""
    return _h(ROOT_TAG + namespace.encode())


@lru_cache(maxsize=256)
def _packer(n: int):  # noqa: ANN202 (struct.Struct.pack)
    return struct.Struct(f">Q{n}I").pack  # be64(parent) + be32 per token id: no padding in ">" mode


def page_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of a page of `token_ids` whose predecessor's hash (or namespace root) is `parent`."""
    return int.from_bytes(hashlib.sha256(_packer(len(token_ids))(parent, *token_ids)).digest()[:8], "big")


def block_hashes(token_ids: Sequence[int], page_size: int, namespace: str = "") -> list[int]:
    """The hashes of every full page of `token_ids` in `namespace`, in order (what a worker's events name)."""
    h, out = root_hash(namespace), []
    for i in range(len(token_ids) // page_size):
        h = page_hash(h, token_ids[i * page_size : (i + 1) * page_size])
        out.append(h)
    return out


def namespace(lora: str = "", cache_salt: str = "") -> str:
    """A request's namespace from its adapter and cache salt, as engine.request.Req.cache_namespace makes it."""
    return f"{lora}{NS_SEP}{cache_salt}" if lora or cache_salt else ""
