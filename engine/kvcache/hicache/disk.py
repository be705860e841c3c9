"""The disk tier: pages of evicted host-tier nodes as files under --hicache-dir, bounded in bytes.

A page is keyed by its chained page hash (`chain`): a hash of the previous page's hash and this
page's token ids, the first page's namespace included, seeded by the pool's layout (shape, dtype),
so a file names one prefix of one namespace and can serve nothing else. One file per page:

    MAGIC (8) | key hash (16) | payload length (8, little endian) | crc32 of the payload (4) | payload

A file that is missing, short, of another key, of another length or whose checksum fails is a miss
(the file is removed and counted in `corrupt`): never wrong KV. The tier starts empty: its directory
(one per worker) is emptied at start-up, so a worker killed mid-write leaks no file past a restart,
and the worker holds a lock file (flock) in it while it lives: at start-up the sibling directories
whose lock nobody holds (workers gone, e.g. an earlier `pdserve up` on other ports) are removed.
Files are written to a temporary name and renamed into place. LRU over whole files bounds the bytes.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import struct
import zlib
from array import array
from collections import OrderedDict

log = logging.getLogger("pdserve.hicache")

MAGIC = b"PDHCv1\0\0"
_HEAD = struct.Struct("<8s16sQI")
SUFFIX = ".kv"
LOCK = ".lock"


def _sweep_stale(parent: str, mine: str) -> None:
    """Remove the worker directories under `parent` (those with a LOCK file) whose lock no live
    process holds."""
    for name in os.listdir(parent):
        d = os.path.join(parent, name)
        if d == mine or not os.path.isfile(os.path.join(d, LOCK)):
            continue
        try:
            with open(os.path.join(d, LOCK)) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue  # held: a live worker's


def chain(prev: bytes, key: tuple) -> bytes:
    """The hash of a page whose predecessor's hash is `prev` and whose radix key is `key` (a first
    page's key starts with its namespace string)."""
    h = hashlib.blake2b(prev, digest_size=16)
    if key and isinstance(key[0], str):
        ns = key[0].encode()
        h.update(b"N" + struct.pack("<I", len(ns)) + ns)
        key = key[1:]
    h.update(b"P" + array("q", key).tobytes())
    return h.digest()


class DiskTier:
    """Content-addressed page files in `root` (emptied at start), at most `max_bytes` of them."""

    def __init__(self, root: str, max_bytes: int, layout: str) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.seed = hashlib.blake2b(layout.encode(), digest_size=16).digest()
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, least recent first
        self.bytes_used = 0
        self.corrupt = 0  # total: files found missing or damaged (each a miss)
        self.evictions = 0  # total: files removed to stay within max_bytes
        os.makedirs(root, exist_ok=True)
        self._lock = open(os.path.join(root, LOCK), "w")  # noqa: SIM115 (held for the process's life)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise ValueError(f"--hicache-dir: {root} is in use by another live worker") from None
        _sweep_stale(os.path.dirname(os.path.abspath(root)), os.path.abspath(root))
        self._remove_all()

    def _path(self, key: bytes) -> str:
        return os.path.join(self.root, key.hex() + SUFFIX)

    def _remove_all(self) -> None:
        for name in os.listdir(self.root):
            if name.endswith(SUFFIX) or name.endswith(".tmp"):
                try:
                    os.unlink(os.path.join(self.root, name))
                except OSError:
                    pass
        self.index.clear()
        self.bytes_used = 0

    def contains(self, key: bytes) -> bool:
        return key in self.index

    def put(self, key: bytes, payload: bytes) -> bool:
        """Store one page (a key already held is only touched). False if it cannot fit or fails."""
        if key in self.index:
            self.index.move_to_end(key)
            return True
        size = _HEAD.size + len(payload)
        if size > self.max_bytes:
            return False
        while self.bytes_used + size > self.max_bytes and self.index:
            self._drop(next(iter(self.index)))
            self.evictions += 1
        tmp = self._path(key) + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_HEAD.pack(MAGIC, key, len(payload), zlib.crc32(payload)))
                f.write(payload)
            os.replace(tmp, self._path(key))
        except OSError as e:
            log.warning("hicache disk write failed (%s): page not kept", e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self.index[key] = size
        self.bytes_used += size
        return True

    def get(self, key: bytes, nbytes: int) -> bytes | None:
        """The payload of `key` if its file is whole and checks out (`nbytes` long), else None."""
        if key not in self.index:
            return None
        try:
            with open(self._path(key), "rb") as f:
                head = f.read(_HEAD.size)
                payload = f.read(nbytes + 1)
        except OSError:
            head, payload = b"", b""
        ok = len(head) == _HEAD.size
        if ok:
            magic, k, n, crc = _HEAD.unpack(head)
            ok = magic == MAGIC and k == key and n == nbytes == len(payload) and zlib.crc32(payload) == crc
        if not ok:
            self.corrupt += 1
            log.warning("hicache disk block %s is missing or corrupt: a miss", key.hex())
            self._drop(key)
            return None
        self.index.move_to_end(key)
        return payload

    def _drop(self, key: bytes) -> None:
        self.bytes_used -= self.index.pop(key, 0)
        try:
            os.unlink(self._path(key))
        except OSError:
            pass

    def clear(self) -> int:
        """Remove every page file; returns how many there were."""
        n = len(self.index)
        self._remove_all()
        return n
