"""Image inputs (service/images.py): loading from data:, http(s) and file URLs within the limits, decoding with
the pixel guard, the Qwen2-VL family's preprocessing against transformers' own, hashes and pad values; the
image flags (service/config.py ImageConfig). No network: http against a local server thread."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import json
import os
import socketserver
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from service.config import ImageConfig, build_parser, server_config_from_args
from service.images import (
    ImageError,
    ImageProcessor,
    ProcessedImage,
    decode_image,
    load_image,
    load_image_async,
    prepare_images,
)

CFG = ImageConfig()
MEAN = [0.48145466, 0.4578275, 0.40821073]
STD = [0.26862954, 0.26130258, 0.27577711]


def rand_image(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def encode(img: Image.Image, fmt: str = "PNG", **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_header_only(w: int, h: int) -> bytes:
    """A PNG that claims w x h RGB pixels but holds one tiny IDAT: only a header check can refuse it cheaply."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b""))


def refused(fn, *args, match: str = "", **kw) -> ImageError:  # noqa: ANN001
    with pytest.raises(ImageError, match=match) as ei:
        fn(*args, **kw)
    assert ei.value.status == 400 and ei.value.message
    return ei.value


def arefused(coro, match: str = "") -> ImageError:  # noqa: ANN001
    with pytest.raises(ImageError, match=match) as ei:
        asyncio.run(coro)
    assert ei.value.status == 400
    return ei.value


# ---------------------------------------------------------------- data: URLs and decoding


@pytest.mark.parametrize("fmt,mime", [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp"),
                                      ("PNG", "application/octet-stream"), ("JPEG", "")])
def test_data_urls_decode_whatever_their_media_type_says(fmt, mime):
    src = rand_image(37, 23)
    raw = encode(src, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    url = data_url(raw, mime) if mime else "data:;base64," + base64.b64encode(raw).decode()
    data = load_image(url, 0, CFG)
    assert data == raw
    img = decode_image(data, 0, CFG)
    assert img.mode == "RGB" and img.size == (37, 23)
    if fmt != "JPEG":  # lossless
        assert np.array_equal(np.asarray(img), np.asarray(src))


def test_data_url_base64_with_whitespace_urlsafe_and_no_padding():
    raw = encode(rand_image(5, 7))
    b64 = base64.b64encode(raw).decode()
    assert load_image("data:image/png;base64," + "\n".join(b64[i:i + 60] for i in range(0, len(b64), 60)), 0,
                      CFG) == raw
    assert load_image("data:image/png;base64," + base64.urlsafe_b64encode(raw).decode().rstrip("="), 0, CFG) == raw


def test_gif_first_frame_and_transparency_on_white():
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50)
    img = decode_image(load_image(data_url(buf.getvalue(), "image/gif"), 0, CFG), 0, CFG)
    assert img.mode == "RGB" and img.getpixel((3, 3)) == (255, 0, 0)
    clear = Image.new("RGBA", (4, 4), (10, 20, 30, 0))
    assert decode_image(encode(clear), 0, CFG).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied():
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90
    img = decode_image(encode(rand_image(30, 10), "JPEG", exif=exif), 0, CFG)
    assert img.size == (10, 30)


def test_bad_data_urls_are_refused_naming_the_image():
    e = refused(load_image, "data:image/png;base64,@@not base64!!", 3, CFG, match="base64")
    assert e.index == 3 and e.message.startswith("image 3:")
    refused(load_image, "data:image/png;base64", 0, CFG, match="no ','")
    refused(load_image, "data:image/png;base64,", 0, CFG, match="no data")
    refused(decode_image, b"definitely not an image", 1, CFG, match="image 1: is not an image")
    refused(decode_image, b"", 0, CFG, match="empty")
    refused(decode_image, b"%PDF-1.4 nope", 0, CFG, match="not an image")


def test_truncated_image_is_refused():
    raw = encode(rand_image(200, 200))
    refused(decode_image, raw[: len(raw) * 6 // 10], 0, CFG, match="truncated")
    jpeg = encode(rand_image(200, 200), "JPEG")
    refused(decode_image, jpeg[: len(jpeg) // 2], 0, CFG, match="truncated")


def test_too_many_bytes_is_refused_before_decoding():
    small = ImageConfig(max_image_bytes=1000)
    raw = encode(rand_image(64, 64))
    assert len(raw) > 1000
    refused(load_image, data_url(raw), 0, small, match="more than this server takes .1000, --max-image-bytes")
    refused(load_image, "data:image/png;base64," + "A" * 10_000_000, 0, small, match="max-image-bytes")
    refused(decode_image, raw, 0, small, match="max-image-bytes")


def test_too_many_pixels_is_refused_from_the_header():
    # 8000 x 8000 = 64M: over the default 40M, under PIL's own 2x (it only warns there); the header says so
    with pytest.warns(Image.DecompressionBombWarning):
        refused(decode_image, png_header_only(8000, 8000), 0, CFG, match=r"8000x8000 = 64000000 pixels.*40000000")
    refused(decode_image, png_header_only(100_000, 100_000), 0, CFG, match="pixels")  # past PIL's guard too
    assert Image.MAX_IMAGE_PIXELS == int(1024 * 1024 * 1024 // 4 // 3)  # PIL's global guard restored
    tiny = ImageConfig(max_image_pixels=100)
    refused(decode_image, encode(rand_image(20, 20)), 0, tiny, match="400 pixels")  # 4x the limit: PIL's error
    assert decode_image(encode(rand_image(10, 10)), 0, tiny).size == (10, 10)


def test_other_schemes_are_refused():
    refused(load_image, "ftp://example.com/a.png", 0, CFG, match="unsupported image URL")
    refused(load_image, "a.png", 0, CFG, match="unsupported image URL")
    refused(load_image, "", 0, CFG, match="has no URL")
    refused(load_image, "http://127.0.0.1:1/a.png", 0, CFG, match="--image-url-fetch")
    refused(load_image, "HTTPS://example.com/a.png", 0, CFG, match="--image-url-fetch")


# ---------------------------------------------------------------- local files


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    d = tmp_path / "imgs"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "a.png").write_bytes(encode(rand_image(9, 9)))
    (tmp_path / "secret.png").write_bytes(encode(rand_image(9, 9, seed=1)))
    os.symlink(tmp_path / "secret.png", d / "link.png")
    os.symlink(d / "sub" / "a.png", d / "inner-link.png")
    return d


def test_files_only_under_the_image_dir(image_dir: Path):
    cfg = ImageConfig(image_dir=str(image_dir))
    inside = image_dir / "sub" / "a.png"
    assert load_image(str(inside), 0, cfg) == inside.read_bytes()
    assert load_image(inside.as_uri(), 0, cfg) == inside.read_bytes()
    assert load_image("file://localhost" + str(inside), 0, cfg) == inside.read_bytes()
    assert load_image(str(image_dir / "inner-link.png"), 0, cfg) == inside.read_bytes()  # a link that stays inside
    secret = image_dir.parent / "secret.png"
    for url in (str(secret), secret.as_uri(), str(image_dir / "sub" / ".." / ".." / "secret.png"),
                f"file://{image_dir}/../secret.png", str(image_dir / "link.png"), "/etc/passwd",
                str(image_dir.parent / "missing.png")):
        refused(load_image, url, 2, cfg, match="image 2: .*outside this server's image directory")
    refused(load_image, str(image_dir / "missing.png"), 0, cfg, match="no readable image file")
    refused(load_image, str(image_dir / "sub"), 0, cfg, match="not a regular file")
    refused(load_image, "file://otherhost" + str(inside), 0, cfg, match="another host")
    refused(load_image, str(inside), 0, ImageConfig(image_dir=str(image_dir), max_image_bytes=10),
            match="max-image-bytes")


def test_files_refused_without_an_image_dir(image_dir: Path):
    refused(load_image, str(image_dir / "sub" / "a.png"), 0, CFG, match="--image-dir")
    refused(load_image, (image_dir / "sub" / "a.png").as_uri(), 0, CFG, match="--image-dir")


# ---------------------------------------------------------------- http(s)

SMALL_PNG = encode(rand_image(12, 8, seed=5))


class _Handler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def _head(self, code: int = 200, length: int | None = None, **extra: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "image/png")
        if length is not None:
            self.send_header("Content-Length", str(length))
        for k, v in extra.items():
            self.send_header(k.replace("_", "-"), v)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        try:
            if self.path == "/small.png":
                self._head(length=len(SMALL_PNG))
                self.wfile.write(SMALL_PNG)
            elif self.path == "/redirect":
                self._head(302, 0, Location="/small.png")
            elif self.path == "/declared-huge":
                self._head(length=10**9)
                self.wfile.write(SMALL_PNG)
            elif self.path == "/stream-huge":  # no length: close-delimited, more than the cap
                self._head()
                for _ in range(100):
                    self.wfile.write(b"\0" * 10_000)
            elif self.path == "/slow":  # a byte every 0.1 s: each read is quick, the whole fetch is not
                self._head()
                for _ in range(50):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.1)
            elif self.path == "/gzip":
                self._head(length=len(SMALL_PNG), Content_Encoding="gzip")
                self.wfile.write(SMALL_PNG)
            else:
                self._head(404, 0)
        except (BrokenPipeError, ConnectionResetError):
            pass


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(k, raising=False)


FETCH = ImageConfig(image_url_fetch=True, image_fetch_timeout_s=0.5, max_image_bytes=100_000)


def test_http_refused_when_off(server: str):
    refused(load_image, server + "/small.png", 0, CFG, match="--image-url-fetch")
    arefused(load_image_async(server + "/small.png", 1, CFG), match="image 1: .*--image-url-fetch")


def test_http_fetch_when_on(server: str):
    assert asyncio.run(load_image_async(server + "/small.png", 0, FETCH)) == SMALL_PNG
    assert asyncio.run(load_image_async(server + "/redirect", 0, FETCH)) == SMALL_PNG
    assert load_image(server + "/small.png", 0, FETCH) == SMALL_PNG


def test_http_size_cap_status_and_encoding(server: str):
    for path in ("/declared-huge", "/stream-huge"):
        arefused(load_image_async(server + path, 0, FETCH), match="max-image-bytes")
        refused(load_image, server + path, 0, FETCH, match="max-image-bytes")
    arefused(load_image_async(server + "/nothing", 0, FETCH), match="HTTP 404")
    arefused(load_image_async(server + "/gzip", 0, FETCH), match="Content-Encoding gzip")
    arefused(load_image_async("http://127.0.0.1:1/x.png", 0, FETCH), match="could not fetch")


def test_http_timeout_is_for_the_whole_fetch(server: str):
    t0 = time.monotonic()
    arefused(load_image_async(server + "/slow", 0, FETCH), match=r"more than 0.5 s \(--image-fetch-timeout\)")
    refused(load_image, server + "/slow", 0, FETCH, match="--image-fetch-timeout")
    assert time.monotonic() - t0 < 3


# ---------------------------------------------------------------- a request's images


def test_too_many_images_and_text_only_model_are_refused():
    url = data_url(encode(rand_image(4, 4)))
    proc = object()  # never reached
    arefused(prepare_images([url] * 3, proc, ImageConfig(max_images_per_request=2)),  # type: ignore[arg-type]
             match="3 images, more than this server takes per request .2, --max-images-per-request")
    arefused(prepare_images([url], None, CFG), match="this model does not take images")
    assert asyncio.run(prepare_images([], None, CFG)) == []


def test_the_first_bad_image_is_named(processor: ImageProcessor, server: str):
    good = data_url(encode(rand_image(4, 4)))
    arefused(prepare_images([good, "data:image/png;base64,!!", good], processor, CFG), match="^image 1: ")
    arefused(prepare_images([good, good, "data:image/png;base64," + base64.b64encode(b"junk").decode()],
                            processor, CFG), match="^image 2: is not an image")
    arefused(prepare_images([server + "/slow", "ftp://x"], processor, FETCH), match="^image 1: unsupported")


# ---------------------------------------------------------------- preprocessing


def write_config(d: Path, **conf: object) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "preprocessor_config.json").write_text(json.dumps(conf))
    return d


QWEN25 = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
          "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 32, "patch_size": 14, "temporal_patch_size": 2,
          "merge_size": 2, "image_mean": MEAN, "image_std": STD, "do_resize": True, "do_rescale": True,
          "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True, "resample": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("qwen25vl"), **QWEN25)


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> ImageProcessor:
    proc = ImageProcessor.from_model_dir(model_dir)
    assert proc is not None and proc.merge_size == 2 and proc.patch_size == 14
    return proc


@pytest.mark.parametrize("size", [(37, 23), (300, 100), (20, 200)])
def test_processing_equals_transformers(processor: ImageProcessor, model_dir: Path, size: tuple[int, int]):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    src = rand_image(*size, seed=sum(size))
    ref = Qwen2VLImageProcessorPil.from_pretrained(str(model_dir))(images=src, return_tensors="np")
    [got] = asyncio.run(prepare_images([data_url(encode(src))], processor, CFG))
    assert isinstance(got, ProcessedImage)
    assert got.pixel_values.dtype == np.float32 and got.pixel_values.flags.c_contiguous
    assert got.pixel_values.shape == ref["pixel_values"].shape
    assert np.array_equal(got.pixel_values, ref["pixel_values"])
    assert got.grid_thw == tuple(int(x) for x in ref["image_grid_thw"][0])
    t, h, w = got.grid_thw
    assert got.pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
    assert got.tokens == t * h * w // 4 and h * 14 * w * 14 <= 28 * 28 * 32
    assert "torchvision" not in sys.modules


def test_hash_and_pad_value(processor: ImageProcessor):
    a, b = encode(rand_image(40, 30, seed=1)), encode(rand_image(40, 30, seed=2))
    x, y, z = asyncio.run(prepare_images([data_url(a), data_url(a), data_url(b)], processor, CFG))
    assert len(x.hash) == 16 and x.hash == y.hash and x.grid_thw == z.grid_thw and x.hash != z.hash
    assert x.pad_value(151_936) == y.pad_value(151_936) != z.pad_value(151_936)
    for p in (x, z):
        assert 151_936 <= p.pad_value(151_936) < 151_936 + 2**30
    same_bytes_other_format = encode(rand_image(40, 30, seed=1), "WEBP", lossless=True)  # same pixels, new bytes
    [w] = asyncio.run(prepare_images([data_url(same_bytes_other_format, "image/webp")], processor, CFG))
    assert w.hash == x.hash


def test_processor_configs_of_the_family(tmp_path: Path):
    assert ImageProcessor.from_model_dir(tmp_path) is None  # a text-only model
    qwen3 = write_config(tmp_path / "q3", image_processor_type="Qwen2VLImageProcessorFast",
                         processor_class="Qwen3VLProcessor", patch_size=16, temporal_patch_size=2, merge_size=2,
                         size={"shortest_edge": 64 * 64, "longest_edge": 32 * 32 * 16},
                         image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    proc = ImageProcessor.from_model_dir(qwen3)
    assert proc is not None and proc.patch_size == 16
    out = proc.process(rand_image(100, 60))
    t, h, w = out.grid_thw
    assert out.pixel_values.shape == (t * h * w, 3 * 2 * 16 * 16) and out.tokens == t * h * w // 4
    assert h % 2 == 0 and w % 2 == 0 and h * w * 256 <= 32 * 32 * 16
    unnamed = write_config(tmp_path / "q2", processor_class="Qwen2VLProcessor", patch_size=14, merge_size=2)
    assert ImageProcessor.from_model_dir(unnamed) is not None
    with pytest.raises(ValueError, match="CLIPImageProcessor.*not supported"):
        ImageProcessor.from_model_dir(write_config(tmp_path / "llava", image_processor_type="CLIPImageProcessor"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "preprocessor_config.json").write_text("{nope")
    with pytest.raises(ValueError, match="JSON"):
        ImageProcessor.from_model_dir(tmp_path / "broken")


def test_extreme_aspect_ratio_is_an_image_error(processor: ImageProcessor):
    arefused(prepare_images([data_url(encode(rand_image(1000, 4)))], processor, CFG), match="image 0: .*aspect")


# ---------------------------------------------------------------- flags


def test_image_flags_reach_the_server_config(tmp_path: Path):
    for role in ("colocated", "prefill", "decode"):
        assert server_config_from_args(build_parser(role).parse_args(["--device", "cpu"]), role).images == CFG
    ns = build_parser("colocated").parse_args([
        "--device", "cpu", "--image-url-fetch", "--image-fetch-timeout", "2.5", "--max-image-bytes", "1000",
        "--image-dir", str(tmp_path), "--max-images-per-request", "3", "--max-image-pixels", "5000"])
    assert server_config_from_args(ns, "colocated").images == ImageConfig(
        image_url_fetch=True, image_fetch_timeout_s=2.5, max_image_bytes=1000, image_dir=str(tmp_path),
        max_images_per_request=3, max_image_pixels=5000)
    assert (CFG.image_url_fetch, CFG.image_fetch_timeout_s, CFG.max_image_bytes, CFG.image_dir,
            CFG.max_images_per_request, CFG.max_image_pixels) == (False, 10.0, 20 * 2**20, "", 8, 40_000_000)
    for flags, name in ((["--image-fetch-timeout", "0"], "--image-fetch-timeout"),
                        (["--image-dir", str(tmp_path / "none")], "--image-dir"),
                        (["--max-images-per-request", "-1"], "--max-images-per-request")):
        with pytest.raises(ValueError, match=name):
            server_config_from_args(build_parser("decode").parse_args(["--device", "cpu", *flags]), "decode")
    text = build_parser("prefill").format_help()
    assert "image inputs" in text and "--max-image-pixels" in text
