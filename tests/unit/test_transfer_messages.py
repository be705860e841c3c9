"""Messages codec, config validation, compatibility check and segment planning (pure Python)."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch

from transfer import CompatInfo, TransferConfig
from transfer import messages as m
from transfer.backend import make_tag
from transfer.layout import page_view, plan_segments

ALL = [
    m.BootstrapQuery("e1"),
    m.PrefillRegistration("e2", "tcp://127.0.0.1:5000", b"\x00\x01ucx"),
    m.TransferInfo(2**62 + 5, "e1", b"addr", [3, 4, 9], 17, "abc", {"model": "x"}, token="t"),
    m.TransferStatus(1, 2, "ok"),
    m.ChunkManifest(1, [[0, [0, 1]], [1, [2]]], 3, True, {"first_token": 5, "room": 1}),
    m.Abort(1, "why", 499),
    m.AbortAck(1),
    m.Heartbeat("e1", 3, [1, 2]),
]


@pytest.mark.parametrize("msg", ALL, ids=lambda x: type(x).__name__)
def test_roundtrip(msg):
    assert m.decode(m.encode(msg)) == msg


def test_version_mismatch_and_unknown_type_raise():
    d = dataclasses.asdict(m.AbortAck(1)) | {"type": "AbortAck", "version": 99}
    with pytest.raises(ValueError, match="version 99"):
        m.decode(msgpack.packb(d))
    with pytest.raises(ValueError, match="unknown"):
        m.decode(msgpack.packb({"type": "Nope", "version": 1}))
    with pytest.raises(ValueError, match="AbortAck"):
        m.decode(msgpack.packb({"type": "AbortAck", "version": 1}))  # missing room
    with pytest.raises(ValueError):
        m.decode(b"\xc1garbage")
    with pytest.raises(ValueError, match="not a transfer message"):
        m.encode(object())


def test_config_validation():
    with pytest.raises(ValueError, match="role"):
        TransferConfig(role="router")
    with pytest.raises(ValueError, match="backend"):
        TransferConfig(role="prefill", backend="nixl")
    with pytest.raises(ValueError, match="waiting_timeout_s"):
        TransferConfig(role="decode", waiting_timeout_s=0)
    with pytest.raises(ValueError, match="bootstrap_port"):
        TransferConfig(role="prefill", bootstrap_port=70000)
    assert TransferConfig(role="decode", heartbeat_interval_s=0.5).peer_lost_s == 1.5


def test_compat_mismatch_names_the_field():
    a = CompatInfo("smollm2", "float32", 16, "page_major", 30, 3, 64)
    b = dataclasses.replace(a, dtype="bfloat16")
    assert a.digest() != b.digest() and a.digest() == CompatInfo(**a.to_dict()).digest()
    assert a.mismatch(a.to_dict()) is None
    msg = a.mismatch(b.to_dict())
    assert "'dtype'" in msg and "float32" in msg and "bfloat16" in msg


def test_page_view_shares_storage():
    pool = torch.zeros(4, 2, 2, 3, 1, 5)  # [pages, layers, 2, page_size, heads, head_dim]
    v = page_view(pool)
    assert v.shape == (4, 2 * 2 * 3 * 5 * 4) and v.dtype == torch.uint8
    v[2].fill_(0xFF)
    assert torch.isnan(pool[2]).all() and (pool[1] == 0).all()
    with pytest.raises(ValueError, match="contiguous"):
        page_view(pool.transpose(0, 1))


def test_plan_direct_runs_and_staged_rest():
    # page_bytes 100, direct runs need >= 300 bytes (3 pages)
    src = [10, 11, 12, 13, 40, 7, 8, 20]
    dst = [0, 0, 5, 6, 7, 8, 30, 31, 32, 50]  # chunk goes to positions 2..9
    segs = plan_segments(src, dst, 2, 100, direct_min_bytes=300, stage_max_bytes=200)
    direct = [s for s in segs if len(s.positions) == 4]
    assert direct and direct[0].src_pages == [10, 11, 12, 13] and direct[0].positions == [2, 3, 4, 5]
    covered = sorted(p for s in segs for p in s.positions)
    assert covered == list(range(2, 10))
    assert all(len(s.positions) <= 2 for s in segs if s not in direct)  # stage cap 200 bytes
    for s in segs:
        assert [src[p - 2] for p in s.positions] == s.src_pages
    with pytest.raises(ValueError, match="overflow"):
        plan_segments(src, dst, 5, 100)


def test_tag_packs_slot_and_seq():
    assert make_tag(3, 7) == (3 << 32) | 7
    with pytest.raises(ValueError):
        make_tag(0, 1)
    with pytest.raises(ValueError):
        make_tag(1, 1 << 32)
