"""Images in a prompt without a model: pad values, chunk pieces, rope rows, the tower's cache
(engine/extras/multimodal.py), and the prompt's image tokens between parse and worker (service/image_prompt.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.extras import multimodal as mm
from engine.forward.forward_batch import Segment, build_batch
from engine.request_groups import ImageInput
from engine.sampling.params import SamplingParams
from service import image_prompt
from service.messages import GenerateReq, decode, encode
from service.parsed import Limits, ParsedRequest, RequestError

H = 4


def _input(seed: int, offset: int, tokens: int, grid=(1, 2, 2)) -> ImageInput:
    px = torch.full((tokens * 4, 3), float(seed))
    return ImageInput(hash=bytes([seed]) * 16, offset=offset, tokens=tokens, grid=list(grid),
                      pixels=px.numpy().tobytes(), dim=3)


def test_attach_writes_pad_values_that_tell_images_apart():
    ids = list(range(10))
    m = mm.attach(ids, [_input(1, 2, 3), _input(2, 6, 3)])
    assert ids[:2] == [0, 1] and ids[5] == 5 and ids[9] == 9
    a, b = ids[2], ids[6]
    assert ids[2:5] == [a] * 3 and ids[6:9] == [b] * 3 and a != b
    assert all(mm.PAD_BASE <= v < 2**32 for v in (a, b))  # past any vocabulary, within the events' be32 ids
    assert mm.pad_value(bytes([1]) * 16) == a  # a pure function of the hash: the same image, the same key
    assert m.images[0].pixels.shape == (12, 3) and m.images[1].grid == (1, 2, 2)


class _Tower:
    def __init__(self, deep: bool = False) -> None:
        self.calls: list[int] = []
        self.deep = deep

    def encode_images(self, pixels: torch.Tensor, grids: torch.Tensor):
        self.calls.append(grids.shape[0])
        n = pixels.shape[0] // 4  # the fake processor: 4 patch rows per image token
        rows = pixels[::4, :1].expand(-1, H) + torch.arange(n, dtype=pixels.dtype).unsqueeze(1) / 100
        return rows, (torch.stack([rows, -rows]) if self.deep else None)


def _request(*inputs: ImageInput, length: int = 12) -> mm.Multimodal:
    m = mm.attach(list(range(length)), list(inputs))
    m.positions = torch.arange(length).unsqueeze(0).repeat(3, 1) * torch.tensor([[1], [2], [3]])
    m.delta = -5
    return m


def test_encoder_runs_once_per_image_and_caches_by_hash():
    tower = _Tower()
    enc = mm.Encoder(tower, "cpu", torch.float32, cache_bytes=1 << 20)
    a = _request(_input(1, 2, 3), _input(1, 6, 3))  # the same image twice in one prompt
    enc.encode(mm.needed(a, 0, 12))
    assert tower.calls == [1] and enc.images_encoded == 1
    assert torch.equal(a.images[0].features[0], a.images[1].features[0])
    b = _request(_input(1, 4, 3))  # a later request with that image: the cache
    enc.encode(mm.needed(b, 0, 12))
    assert tower.calls == [1] and enc.cache_hits == 1
    c = _request(_input(2, 4, 3))  # another image of the same size: the tower
    enc.encode(mm.needed(c, 0, 12))
    assert tower.calls == [1, 1] and enc.images_encoded == 2
    assert not torch.equal(b.images[0].features[0], c.images[0].features[0])


def test_encoder_cache_is_bounded_lru():
    enc = mm.Encoder(_Tower(), "cpu", torch.float32, cache_bytes=3 * H * 4 * 2)  # two images' rows
    for seed in (1, 2, 1, 3):  # 1 is used again before 3 arrives: 2 is the least recent
        enc.encode(mm.needed(_request(_input(seed, 0, 3)), 0, 3))
    assert set(enc.cache) == {bytes([1]) * 16, bytes([3]) * 16} and enc.cached_bytes <= enc.cache_bytes
    none = mm.Encoder(_Tower(), "cpu", torch.float32, cache_bytes=0)
    r = _request(_input(1, 0, 3))
    none.encode(mm.needed(r, 0, 3))
    assert r.images[0].features is not None and not none.cache


def test_chunks_take_their_pieces_of_each_image_and_their_rope_rows():
    tower = _Tower(deep=True)
    m = _request(_input(1, 2, 3), _input(2, 6, 3))
    enc = mm.Encoder(tower, "cpu", torch.float32, cache_bytes=1 << 20)
    enc.encode(mm.needed(m, 4, 4))  # a chunk [4, 8): the first image's last row, the second's first two
    assert tower.calls == [2]
    extras = mm.prepare(m, 4, 4, prompt=True)
    seg = Segment(pages=[0, 1], start=4, tokens=[0] * 4, extras=extras)
    batch = build_batch([Segment(pages=[2], start=0, tokens=[9] * 3), seg], page_size=8)
    (r1, e1), (r2, e2) = batch.embeds
    assert (r1, r2) == (3 + 0, 3 + 2)  # rows in the batch: after the first segment's 3
    assert torch.equal(e1, m.images[0].features[0][2:3]) and torch.equal(e2, m.images[1].features[0][0:2])
    assert [r for r, _ in batch.deepstack] == [3, 5] and batch.deepstack[1][1].shape == (2, 2, H)
    (row, pos), = batch.rope3
    assert row == 3 and torch.equal(pos, m.positions[:, 4:8])
    tail = mm.rope_rows(m, 10, 4)  # the prompt's last 2 rows, then 2 output positions at p + delta
    assert torch.equal(tail[:, :2], m.positions[:, 10:12]) and tail[:, 2:].tolist() == [[7, 8]] * 3
    (dec,) = mm.prepare(m, 12, 1, prompt=False)
    assert dec.positions.tolist() == [[7]] * 3
    m.release()
    assert all(im.pixels is None and im.features is None for im in m.images)


def test_images_travel_in_the_generate_message():
    msg = GenerateReq(rid="r", input_ids=[1, 2, 3], sampling=SamplingParams(), images=[_input(7, 1, 1)])
    back = decode(encode(msg))
    assert back.images == msg.images


class _Processed:
    def __init__(self, tokens: int, seed: int) -> None:
        self.tokens, self.grid_thw = tokens, (1, 2, tokens * 2)
        self.hash = bytes([seed]) * 16
        self.pixel_values = np.zeros((tokens * 4, 6), dtype=np.float32)


def _parsed(ids: list[int], resumed: int = 0) -> ParsedRequest:
    sp = SamplingParams(max_new_tokens=50)
    return ParsedRequest(kind="chat", req=GenerateReq(rid="r", input_ids=ids, sampling=sp, resumed_tokens=resumed),
                         model="m")


LIMITS = Limits(role="colocated", context_length=40, vocab_size=100, model_name="m", image_tokens=(90, 91, 92))


def test_locate_and_expand_image_tokens():
    p = _parsed([1, 90, 91, 92, 2, 90, 91, 92, 3, 91], resumed=1)  # the last id is a resumed stream's output
    image_prompt.locate(p, ["a", "b"], LIMITS)
    assert p.image_at == [2, 6]
    image_prompt.expand(p, [_Processed(3, 1), _Processed(2, 2)], LIMITS)
    ids = p.req.input_ids
    assert ids == [1, 90, 91, 91, 91, 92, 2, 90, 91, 91, 92, 3, 91]
    assert [(x.offset, x.tokens) for x in p.req.images] == [(2, 3), (8, 2)]
    assert p.req.sampling.max_new_tokens == 40 - len(ids) and p.req.resumed_tokens == 1
    with pytest.raises(RequestError, match="2 image placeholders for 1 images"):
        image_prompt.locate(_parsed([90, 91, 92, 90, 91]), ["a"], LIMITS)
    big = _parsed([1, 90, 91, 2])
    image_prompt.locate(big, ["a"], LIMITS)
    with pytest.raises(RequestError, match=r"\(40 of them for 1 images\)"):
        image_prompt.expand(big, [_Processed(40, 1)], LIMITS)
    with pytest.raises(RequestError, match="must follow the vision start"):
        image_prompt.locate(_parsed([1, 91, 2]), ["a"], LIMITS)


def test_generate_without_placeholders_gets_one_per_image_in_front():
    assert image_prompt.with_placeholders([5, 6], 2, LIMITS) == [90, 91, 92, 90, 91, 92, 5, 6]
    assert image_prompt.with_placeholders([5, 91, 6], 1, LIMITS) == [5, 91, 6]


def test_row_pool_packs_images_into_pages_and_reads_them_back():
    pool = mm.RowPool(rows=64, layers=3, hidden=H, dtype=torch.float32, device="cpu", page_rows=4)
    a = (torch.randn(5, H), torch.randn(2, 5, H))
    b = (torch.randn(6, H), torch.randn(2, 6, H))
    pages = pool.put([a, b])
    assert len(pages) == 3 and pool.allocator.num_used == 3  # 11 rows in pages of 4
    (ea, da), (eb, db) = pool.take(pages, [5, 6])
    assert torch.equal(ea, a[0]) and torch.equal(da, a[1]) and torch.equal(eb, b[0]) and torch.equal(db, b[1])
    pool.free(pages)
    assert not pool.can_hold(65) and pool.can_hold(64)
    with pytest.raises(ValueError, match="deepstack"):
        pool.put([(torch.randn(2, H), None)])  # this pool carries two deepstack sets per row


def test_image_rows_wire_page_and_compat():
    from service.pd import image_compat

    class Cfg:
        model_type, hidden_size, deepstack_layers = "qwen3_vl", 64, 2

    c = image_compat(Cfg, "bfloat16", 16)
    assert c.page_bytes == 3 * 16 * 64 * 2  # (1 + 2 deepstack) x 16 rows x 64 values x 2 bytes
    assert c.mismatch(image_compat(Cfg, "float32", 16).to_dict()) is not None  # both sides must agree


def test_prefill_reads_the_encoders_bootstrap():
    from service.protocol import parse_bootstrap, parse_encoder

    body = {"bootstrap_host": "p", "bootstrap_port": 1, "bootstrap_room": 9,
            "encoder_bootstrap_host": "e", "encoder_bootstrap_port": 2}
    pd = parse_bootstrap(body, "prefill")
    enc = parse_encoder(body, "prefill", pd)
    assert (enc.host, enc.port, enc.room) == ("e", 2, 9)
    assert parse_encoder(body, "decode", pd).host is None  # only a prefill takes rows from an encoder
    with pytest.raises(RequestError, match="encoder_bootstrap_port"):
        parse_encoder(dict(body, encoder_bootstrap_port=0), "prefill", pd)


def test_encoder_flags_are_the_towers_only():
    from service.config import build_parser

    flags = {a.dest for a in build_parser("encoder")._actions}
    assert {"model", "device", "dtype", "bootstrap_port", "image_transfer_tokens", "image_cache_mb",
            "max_images_per_request"} <= flags
    assert not flags & {"max_total_tokens", "chunked_prefill_size", "lora_paths", "speculative", "prefix_cache"}


def test_images_to_a_text_only_model_are_400s():
    from service.protocol import parse_chat, parse_generate

    text_only = Limits(role="colocated", context_length=40, vocab_size=100, model_name="m")  # no image tokens
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(RequestError, match="does not take images"):
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]},
                   None, text_only)
    with pytest.raises(RequestError, match="does not take images"):
        parse_generate({"input_ids": [1, 2], "image_data": "data:image/png;base64,AAAA"}, None, text_only)
