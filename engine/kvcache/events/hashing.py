"""Block hashes of KV cache events: defined in common/kv_hashing.py (hashlib and struct only), where the
router (router/kv_index.py) imports them too; re-exported here for the engine's recorder.
"""

from common.kv_hashing import ROOT_TAG, block_hashes, page_hash, root_hash

__all__ = ["ROOT_TAG", "block_hashes", "page_hash", "root_hash"]
