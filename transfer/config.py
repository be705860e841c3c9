"""Frozen configuration of the KV transfer layer, and the compatibility record of a KV pool.

TransferConfig  how one worker process's TransferManager runs (role, addresses, timeouts, token)
CompatInfo      what a KV page means (model, dtype, page size, layout, heads) and the sender's tensor
                parallel size; both sides must agree on every field but the servable ones (`tp`: the
                wire page holds all KV heads whatever a side's TP), checked by hash at the handshake,
                and a mismatch names the differing field.

Validation raises ValueError with a message naming the field.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

ROLES = ("prefill", "decode")
BACKENDS = ("ucx", "fake")


@dataclass(frozen=True)
class TransferConfig:
    role: str  # "prefill" | "decode"
    advertise_host: str = "127.0.0.1"  # address peers use for zmq control (and where we bind)
    bootstrap_port: int = 8998  # prefill only: bootstrap server port (0 = pick a free port)
    backend: str = "ucx"  # "ucx" | "fake" (fake moves no bytes: unit tests only)
    bootstrap_timeout_s: float = 60.0  # prefill: sender fails if no TransferInfo for its room by then
    waiting_timeout_s: float = 120.0  # decode: receiver fails if KV not complete by then
    heartbeat_interval_s: float = 5.0  # 3 missed -> all rooms with that peer FAILED
    cluster_token: str | None = None  # when set, control messages without it are refused
    progress_thread: bool = True  # progress zmq, UCX and heartbeats on a thread while a forward runs

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if not self.advertise_host:
            raise ValueError("advertise_host must not be empty")
        if not 0 <= self.bootstrap_port < 65536:
            raise ValueError(f"bootstrap_port must be in 0..65535, got {self.bootstrap_port}")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "heartbeat_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.cluster_token is not None and not self.cluster_token:
            raise ValueError("cluster_token must be None or a non-empty string")

    @property
    def peer_lost_s(self) -> float:
        """A peer silent for this long (3 heartbeats) is lost."""
        return 3.0 * self.heartbeat_interval_s


_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
SERVABLE = ("tp",)  # CompatInfo fields two sides may differ in: they are shown, never compared


@dataclass(frozen=True)
class CompatInfo:
    """What one wire KV page holds. Hashed into TransferInfo (servable fields left out); both sides
    must match field by field except SERVABLE ones.

    The wire page is the model's canonical page [layers, 2, page_size, num_kv_heads (all), head_dim]
    whatever either side's tensor parallel size: a TP > 1 side stages (gathers its ranks' heads into
    full pages before sending, scatters them after receiving), so any prefill TP serves any decode TP.
    """

    model: str
    dtype: str
    page_size: int
    kv_layout: str  # e.g. "page_major:[pages,layers,2,page_size,kv_heads,head_dim]"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    # what the KV pages store: the model dtype's name, or "fp8_e4m3" (--kv-cache-dtype: float8 codes and a float32
    # scale per row, D + 4 bytes a row: engine/kv_fp8.py); "" = as `dtype`. Compared: a decode whose KV dtype
    # differs from its prefill's is refused with 412 naming this field
    kv_cache_dtype: str = ""
    window: int = 0  # tokens the widest layer looks back (sliding window); 0 = full attention.
    # The prefill sends, and the decode reserves, only the pages of the prompt's last window.
    tp: int = 1  # this side's tensor parallel size (servable: not compared)
    # MLA (DeepSeek) latent pages [layers, page_size, kv_lora_rank + qk_rope_head_dim]: one latent per token
    # and layer, the same on every TP rank (num_kv_heads 1, head_dim unused); 0 = ordinary K/V pages
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # speculative decoding (engine/extras/speculative): both sides of a pair run the same method and draft
    # model, or the pair is refused (412 naming the field) instead of decoding with a config mismatch
    speculative: str = ""  # "", ngram or draft
    draft_model: str = ""  # the draft model's directory name ("" unless speculative == draft)
    # hybrid recurrent models (engine/recurrent/state_pool.py): the layout of one request's state slot, sent
    # after the prompt's last KV page in `ceil(slot bytes / page_bytes)` extra wire pages; "" = no state
    state_layout: str = ""
    # an encoder -> prefill room (vision-language models, E/P/D): pages of image-embedding rows [num_layers (the
    # tower's output and its deepstack features), page_size rows, image_rows values]; 0 = KV pages
    image_rows: int = 0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    @property
    def page_bytes(self) -> int:
        """Bytes of one wire page (all KV heads; K and V of every layer; MLA: the latents of every layer)."""
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r} has no known element size ({sorted(_ITEMSIZE)})")
        itemsize = _ITEMSIZE[self.dtype]
        if self.image_rows:  # a page of image-embedding rows
            return self.num_layers * self.page_size * self.image_rows * itemsize
        fp8 = self.kv_cache_dtype == "fp8_e4m3"  # one byte a value, then a 4-byte scale per row

        def row(values: int) -> int:
            return values + 4 if fp8 else values * itemsize

        if self.kv_lora_rank:  # a latent page
            return self.num_layers * self.page_size * row(self.kv_lora_rank + self.qk_rope_head_dim)
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * row(self.head_dim)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Hash of the fields both sides must share (SERVABLE ones left out)."""
        shared = {k: v for k, v in self.to_dict().items() if k not in SERVABLE}
        blob = json.dumps(shared, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def mismatch(self, other: dict) -> str | None:
        """None when `other` (a peer's to_dict()) equals this on every non-servable field; else a
        message naming the first differing field."""
        mine = self.to_dict()
        for name, value in mine.items():
            if name in SERVABLE:
                continue
            theirs = other.get(name)
            if theirs != value:
                what = " (the KV cache dtype, --kv-cache-dtype)" if name == "kv_cache_dtype" else ""
                return f"KV compatibility mismatch on field {name!r}{what}: prefill={value!r} decode={theirs!r}"
        extra = sorted(set(other) - set(mine))
        if extra:
            return f"KV compatibility mismatch: unknown fields {extra}"
        return None
