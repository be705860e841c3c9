"""Image inputs of vision-language models: a request's images from URL to what the model's vision tower takes.

load_image(_async)  the encoded bytes of one image URL: a `data:` URL (base64 or percent-encoded; its media type
                    is not trusted, the bytes decide), an http(s) URL when --image-url-fetch allows it (streamed,
                    at most --max-image-bytes, within --image-fetch-timeout in all), a local file (`file://` URL or
                    absolute path) only under --image-dir, after symlinks and `..` are resolved
decode_image        those bytes as one RGB PIL image (PNG, JPEG, WebP, GIF's first frame, BMP): the size is read
                    from the header and checked against --max-image-pixels before any pixel is decoded (PIL's own
                    bomb guard set to the same limit while it reads the header), then decoded in full (a truncated
                    image is refused), EXIF orientation applied, transparency composited on white
ImageProcessor      the model's preprocessing (preprocessor_config.json of the Qwen2-VL family: Qwen2-VL, Qwen2.5-VL,
                    Qwen3-VL), run by transformers' PIL image processor (no torchvision)
ProcessedImage      one image's pixel_values [P, D] and grid (t, h, w), how many pad tokens it takes in the prompt
                    and a hash of its pixels that the prefix cache tells images apart by (`pad_value`)
prepare_images      a request's images in order, all of the above; loads run concurrently, decoding and
                    preprocessing on a worker thread so one big image never stalls the event loop

Every refusal is an `ImageError`: a 400 whose message names the image by its 0-based index in the request
and says why.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import json
import os
import re
import stat
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image, ImageOps

from service.config import ImageConfig
from service.parsed import RequestError

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")  # the decoders PIL may pick (no TIFF, PSD, EPS, ...)
# image_processor_type (or, without one, processor_class) of the preprocessor configs of the Qwen2-VL family on the
# hub: Qwen2-VL and Qwen2.5-VL name Qwen2VLImageProcessor, Qwen3-VL Qwen2VLImageProcessorFast (patch 16); every one
# is run by transformers' PIL class of that family (the torchvision one would need torchvision)
QWEN2_VL_IMAGE_PROCESSORS = frozenset({
    "Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil",
    "Qwen2_5_VLImageProcessor", "Qwen2_5_VLImageProcessorFast",
    "Qwen3VLImageProcessor", "Qwen3VLImageProcessorFast",
})
QWEN2_VL_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor",
                                 "Qwen3VLMoeProcessor"})
_PIL_GUARD = threading.Lock()  # PIL's bomb guard is a module global: set and restored around each header read
_WS = re.compile(r"\s+")


class ImageError(RequestError):
    """A request image this service refuses (400): `index` is its 0-based place among the request's images
    (None: the request's images as a whole)."""

    def __init__(self, reason: str, index: int | None = None) -> None:
        super().__init__(reason if index is None else f"image {index}: {reason}")
        self.index = index


def _short(url: str, n: int = 60) -> str:
    return url if len(url) <= n else url[:n] + "..."


def _too_big(size: int, cfg: ImageConfig, index: int) -> ImageError:
    return ImageError(f"is {size} bytes, more than this server takes ({cfg.max_image_bytes}, --max-image-bytes)",
                      index)


# ---------------------------------------------------------------- loading


def _kind(url: object, index: int, cfg: ImageConfig) -> str:
    """data | http | file, or ImageError for anything else (or http while fetching is off)."""
    if not isinstance(url, str) or not url.strip():
        raise ImageError("has no URL", index)
    head = url[:8].lower()
    if head.startswith("data:"):
        return "data"
    if head.startswith(("http://", "https://")):
        if not cfg.image_url_fetch:
            raise ImageError("http(s) image URLs are off on this server (--image-url-fetch); send the image as a "
                             "data: URL (data:image/png;base64,...)", index)
        return "http"
    if head.startswith("file:") or url.startswith("/"):
        return "file"
    raise ImageError(f"unsupported image URL {_short(url)!r}: expected a data: URL (data:image/png;base64,...)"
                     + (", an http(s) URL" if cfg.image_url_fetch else "")
                     + (" or a file under this server's image directory" if cfg.image_dir else ""), index)


def _from_data_url(url: str, index: int, cfg: ImageConfig) -> bytes:
    """The bytes of `data:[<media type>][;base64],<data>`; the media type is not looked at (the bytes say what
    the image is)."""
    comma = url.find(",")
    if comma < 0:
        raise ImageError("malformed data: URL (no ',' before the data)", index)
    params = [p.strip().lower() for p in url[5:comma].split(";")]
    payload = url[comma + 1:]
    if "base64" not in params[1:] and params[0] != "base64":
        data = urllib.parse.unquote_to_bytes(payload)
        if len(data) > cfg.max_image_bytes:
            raise _too_big(len(data), cfg, index)
    else:
        if len(payload) > 2 * cfg.max_image_bytes + 1024:  # even allowing for whitespace, far too big to decode
            raise _too_big(len(payload) * 3 // 4, cfg, index)
        if _WS.search(payload):
            payload = _WS.sub("", payload)
        payload = payload.rstrip("=")
        if len(payload) * 3 // 4 > cfg.max_image_bytes:
            raise _too_big(len(payload) * 3 // 4, cfg, index)
        padded = payload + "=" * (-len(payload) % 4)
        try:
            if "-" in payload or "_" in payload:  # the URL-safe alphabet
                data = base64.b64decode(padded, altchars=b"-_", validate=True)
            else:
                data = base64.b64decode(padded, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ImageError(f"the data: URL's base64 is not valid ({e})", index) from e
    if not data:
        raise ImageError("the data: URL holds no data", index)
    return data


def _read_file(url: str, index: int, cfg: ImageConfig) -> bytes:
    """A local file, only under cfg.image_dir: the path resolved (symlinks, `..`) before it is checked, and the
    file opened checked again by what the open descriptor names (no swap between check and open)."""
    if not cfg.image_dir:
        raise ImageError("local image files are off on this server (--image-dir); send the image as a data: URL",
                         index)
    text = url
    if url[:5].lower() == "file:":
        parts = urllib.parse.urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(f"file URL {_short(url)!r} names another host", index)
        text = urllib.parse.unquote(parts.path)
    if not text.startswith("/") or "\x00" in text:
        raise ImageError(f"local image path {_short(url)!r} is not an absolute path", index)
    root = Path(cfg.image_dir).resolve()
    outside = ImageError(f"{_short(url)!r} is outside this server's image directory (--image-dir)", index)
    try:
        path = Path(text).resolve()  # not strict: a missing file and one outside answer alike (no probing)
    except (OSError, RuntimeError) as e:
        raise outside from e
    if not path.is_relative_to(root):
        raise outside
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise ImageError(f"no readable image file {_short(url)!r} in this server's image directory", index) from e
    try:
        opened = f"/proc/self/fd/{fd}"
        if os.path.exists(opened) and not Path(os.path.realpath(opened)).is_relative_to(root):
            raise outside
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ImageError(f"{_short(url)!r} is not a regular file", index)
        if st.st_size > cfg.max_image_bytes:
            raise _too_big(st.st_size, cfg, index)
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(cfg.max_image_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > cfg.max_image_bytes:
        raise _too_big(len(data), cfg, index)
    return data


def _check_response(r: httpx.Response, url: str, index: int, cfg: ImageConfig) -> None:
    if r.status_code != 200:
        raise ImageError(f"fetching {_short(url)!r} answered HTTP {r.status_code}", index)
    encoding = r.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # asked for identity: a compressed body could inflate past any cap
        raise ImageError(f"fetching {_short(url)!r} answered Content-Encoding {encoding}; images must be sent "
                         "unencoded", index)
    length = r.headers.get("content-length", "")
    if length.isdigit() and int(length) > cfg.max_image_bytes:
        raise _too_big(int(length), cfg, index)


_FETCH_HEADERS = {"Accept": "image/*", "Accept-Encoding": "identity"}


def _client_kwargs(cfg: ImageConfig) -> dict[str, Any]:
    return {"timeout": cfg.image_fetch_timeout_s, "follow_redirects": True, "max_redirects": 5}


def _fetch_error(e: Exception, url: str, index: int, cfg: ImageConfig) -> ImageError:
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, httpx.TimeoutException)):
        return ImageError(f"fetching {_short(url)!r} took more than {cfg.image_fetch_timeout_s:g} s "
                          "(--image-fetch-timeout)", index)
    return ImageError(f"could not fetch {_short(url)!r}: {type(e).__name__}: {e}", index)


def _fetch(url: str, index: int, cfg: ImageConfig, client: httpx.Client | None) -> bytes:
    deadline = time.monotonic() + cfg.image_fetch_timeout_s
    own = client is None
    c = client if client is not None else httpx.Client(**_client_kwargs(cfg))
    try:
        with c.stream("GET", url, headers=_FETCH_HEADERS) as r:
            _check_response(r, url, index, cfg)
            buf = bytearray()
            for chunk in r.iter_raw():
                buf += chunk
                if len(buf) > cfg.max_image_bytes:
                    raise _too_big(len(buf), cfg, index)
                if time.monotonic() > deadline:
                    raise TimeoutError
            return bytes(buf)
    except (httpx.HTTPError, httpx.InvalidURL, TimeoutError) as e:
        raise _fetch_error(e, url, index, cfg) from e
    finally:
        if own:
            c.close()


async def _fetch_async(url: str, index: int, cfg: ImageConfig, client: httpx.AsyncClient | None) -> bytes:
    async def body() -> bytes:
        own = client is None
        c = client if client is not None else httpx.AsyncClient(**_client_kwargs(cfg))
        try:
            async with c.stream("GET", url, headers=_FETCH_HEADERS) as r:
                _check_response(r, url, index, cfg)
                buf = bytearray()
                async for chunk in r.aiter_raw():
                    buf += chunk
                    if len(buf) > cfg.max_image_bytes:
                        raise _too_big(len(buf), cfg, index)
                return bytes(buf)
        finally:
            if own:
                await c.aclose()

    try:
        return await asyncio.wait_for(body(), cfg.image_fetch_timeout_s)  # the whole fetch, not each read
    except (httpx.HTTPError, httpx.InvalidURL, asyncio.TimeoutError, TimeoutError) as e:
        raise _fetch_error(e, url, index, cfg) from e


def load_image(url: str, index: int, cfg: ImageConfig, *, client: httpx.Client | None = None) -> bytes:
    """The encoded bytes of image `index` named by `url` (blocking: fetches and reads files on this thread).
    `client`: an httpx.Client to fetch with (its own timeouts and redirects apply; the size cap and the overall
    deadline still do); None: a fresh one per fetch. ImageError for anything this server does not take."""
    kind = _kind(url, index, cfg)
    if kind == "data":
        return _from_data_url(url, index, cfg)
    if kind == "file":
        return _read_file(url, index, cfg)
    return _fetch(url, index, cfg, client)


async def load_image_async(url: str, index: int, cfg: ImageConfig, *,
                           client: httpx.AsyncClient | None = None) -> bytes:
    """As `load_image`, for the event loop: a fetch streams asynchronously within --image-fetch-timeout in all;
    base64 decoding and file reads run on a worker thread."""
    kind = _kind(url, index, cfg)
    if kind == "http":
        return await _fetch_async(url, index, cfg, client)
    return await asyncio.to_thread(_from_data_url if kind == "data" else _read_file, url, index, cfg)


# ---------------------------------------------------------------- decoding


def _open(data: bytes, index: int, cfg: ImageConfig) -> Image.Image:
    """The image's header read (no pixels yet) with PIL's bomb guard at --max-image-pixels (restored after)."""
    with _PIL_GUARD:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = cfg.max_image_pixels
        try:
            return Image.open(io.BytesIO(data), formats=FORMATS)
        except Image.DecompressionBombError as e:
            raise ImageError(f"is too large to decode: {e}", index) from e
        except Image.UnidentifiedImageError as e:
            raise ImageError(f"is not an image this server decodes ({', '.join(FORMATS)})", index) from e
        except Exception as e:  # whatever a broken header makes a decoder raise is the image's fault
            raise ImageError(f"has a broken header: {type(e).__name__}: {e}", index) from e
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _check_pixels(img: Image.Image, index: int, cfg: ImageConfig) -> None:
    w, h = img.size
    if w < 1 or h < 1:
        raise ImageError(f"has no pixels ({w}x{h})", index)
    if w * h > cfg.max_image_pixels:
        raise ImageError(f"is {w}x{h} = {w * h} pixels, more than this server takes ({cfg.max_image_pixels}, "
                         "--max-image-pixels)", index)


def _to_rgb(img: Image.Image) -> Image.Image:
    """RGB as transformers' convert_to_rgb makes it: transparency composited on white."""
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def decode_image(data: bytes, index: int, cfg: ImageConfig) -> Image.Image:
    """Image `index`'s encoded bytes as an RGB PIL image, decoded in full (its first frame when animated).
    Refused before any pixel is decoded when its header's width * height is over --max-image-pixels; refused
    when it is not PNG/JPEG/WebP/GIF/BMP, broken or truncated. EXIF orientation is applied (as transformers'
    load_image does)."""
    if not data:
        raise ImageError("is empty", index)
    if len(data) > cfg.max_image_bytes:
        raise _too_big(len(data), cfg, index)
    img = _open(data, index, cfg)
    _check_pixels(img, index, cfg)
    try:
        img.load()  # the whole first frame: a truncated image raises here (ImageFile.LOAD_TRUNCATED_IMAGES off)
        _check_pixels(img, index, cfg)  # a decoder may grow the canvas to its first frame's extent
        img = ImageOps.exif_transpose(img)
        return _to_rgb(img)
    except ImageError:
        raise
    except Exception as e:  # OSError (truncated), SyntaxError, ValueError, zlib's, ... of bad data
        raise ImageError(f"could not be decoded (broken or truncated): {type(e).__name__}: {e}", index) from e


# ---------------------------------------------------------------- preprocessing


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image as the vision tower takes it. Compare images by `hash` (arrays have no plain ==)."""

    pixel_values: np.ndarray  # float32 [P, D]: P = t*h*w patches, D = channels * temporal * patch * patch
    grid_thw: tuple[int, int, int]  # patches along time, height, width
    tokens: int  # image-pad tokens it takes in the prompt: t*h*w // merge_size**2
    hash: bytes  # 16-byte blake2b of the grid and the pixel values: equal images, equal hashes

    def pad_value(self, vocab_size: int) -> int:
        """A token id at or above `vocab_size` (never a real token) derived from the hash: the prefix cache keys
        the image's pad tokens by it, so different images never share cached KV and equal ones do."""
        return vocab_size + int.from_bytes(self.hash[:4], "little") % (1 << 30)


def image_hash(pixel_values: np.ndarray, grid_thw: tuple[int, int, int]) -> bytes:
    """16-byte blake2b of the grid, the shape and the float32 pixel values."""
    pv = np.ascontiguousarray(pixel_values, dtype=np.float32)
    h = hashlib.blake2b(digest_size=16, person=b"pdserve-image")
    h.update(np.asarray(grid_thw, dtype="<i8").tobytes())
    h.update(np.asarray(pv.shape, dtype="<i8").tobytes())
    h.update(memoryview(pv).cast("B"))
    return h.digest()


class ImageProcessor:
    """A model's image preprocessing: transformers' PIL image processor of the Qwen2-VL family, configured by
    the model's preprocessor_config.json (patch_size, temporal_patch_size, merge_size, min/max pixels or
    `size` {shortest_edge, longest_edge}, mean, std)."""

    def __init__(self, hf: Any, source: str = "") -> None:  # noqa: ANN401
        self.hf = hf
        self.source = source
        self.patch_size = int(hf.patch_size)
        self.temporal_patch_size = int(hf.temporal_patch_size)
        self.merge_size = int(hf.merge_size)

    def __repr__(self) -> str:
        return (f"ImageProcessor({type(self.hf).__name__}, patch={self.patch_size}, merge={self.merge_size}, "
                f"temporal={self.temporal_patch_size}, size={dict(self.hf.size)}, from {self.source or '?'})")

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ImageProcessor | None:
        """The processor of the model in directory `path`; None when it has no preprocessor_config.json (a
        text-only model). ValueError when the file is not JSON or names an image processor other than the
        Qwen2-VL family's (QWEN2_VL_IMAGE_PROCESSORS)."""
        conf_file = Path(path) / "preprocessor_config.json"
        if not conf_file.is_file():
            return None
        try:
            conf = json.loads(conf_file.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{conf_file}: not a readable JSON object: {e}") from e
        if not isinstance(conf, dict):
            raise ValueError(f"{conf_file}: not a JSON object")
        kind = str(conf.get("image_processor_type") or "")
        proc = str(conf.get("processor_class") or "")
        if kind not in QWEN2_VL_IMAGE_PROCESSORS and (kind or proc not in QWEN2_VL_PROCESSORS):
            family = ", ".join(sorted(QWEN2_VL_IMAGE_PROCESSORS))
            raise ValueError(f"{conf_file}: image processor {kind or proc or '(unnamed)'!r} is not supported; "
                             f"pdserve preprocesses images of the Qwen2-VL family ({family})")
        # transformers takes 1-3 s to import: only a model with images loads it; this module needs no torchvision
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        valid = Qwen2VLImageProcessorPil.valid_kwargs.__annotations__
        try:
            hf = Qwen2VLImageProcessorPil(**{k: v for k, v in conf.items() if k in valid})
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"{conf_file}: {type(e).__name__}: {e}") from e
        return cls(hf, str(conf_file))

    def process(self, image: Image.Image) -> ProcessedImage:
        """`image` (RGB) resized, normalised and cut into patches exactly as transformers' processor does it for
        this one image. ValueError where the processor refuses the image (an aspect ratio over 200)."""
        out = self.hf(images=[image], return_tensors="np")
        pixel_values = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        t, h, w = (int(x) for x in np.asarray(out["image_grid_thw"]).reshape(-1, 3)[0])
        grid = (t, h, w)
        return ProcessedImage(pixel_values, grid, t * h * w // self.merge_size ** 2, image_hash(pixel_values, grid))


# ---------------------------------------------------------------- one request's images


def _decode_and_process(data: bytes, index: int, processor: ImageProcessor, cfg: ImageConfig) -> ProcessedImage:
    image = decode_image(data, index, cfg)
    try:
        return processor.process(image)
    except ValueError as e:
        raise ImageError(f"could not be preprocessed for this model: {e}", index) from e


async def _load_all(urls: Sequence[str], cfg: ImageConfig, client: httpx.AsyncClient | None) -> list[bytes]:
    """Every image's bytes, loaded concurrently; the first refusal (by index) cancels the rest."""
    if len(urls) == 1:
        return [await load_image_async(urls[0], 0, cfg, client=client)]
    tasks = [asyncio.ensure_future(load_image_async(u, i, cfg, client=client)) for i, u in enumerate(urls)]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()  # those still loading (a done task ignores it)
        await asyncio.gather(*tasks, return_exceptions=True)  # let them close their fetches
    errors = [e for t in tasks if not t.cancelled() and (e := t.exception()) is not None]
    if errors:
        raise errors[0]  # the lowest index that failed
    return [t.result() for t in tasks]


async def prepare_images(urls: list[str], processor: ImageProcessor | None, cfg: ImageConfig, *,
                         client: httpx.AsyncClient | None = None) -> list[ProcessedImage]:
    """One request's images, in order: refused when the model takes none (`processor` None) or there are more
    than --max-images-per-request; loaded concurrently (`client`: as load_image_async's), then each decoded and
    preprocessed on a worker thread (asyncio.to_thread) so other requests keep being served meanwhile."""
    if not urls:
        return []
    if processor is None:
        raise ImageError("this model does not take images (it has no preprocessor_config.json / is text-only)")
    if len(urls) > cfg.max_images_per_request:
        raise ImageError(f"the request has {len(urls)} images, more than this server takes per request "
                         f"({cfg.max_images_per_request}, --max-images-per-request)")
    blobs = await _load_all(urls, cfg, client)
    out = []
    for i, data in enumerate(blobs):
        out.append(await asyncio.to_thread(_decode_and_process, data, i, processor, cfg))
        blobs[i] = b""  # its bytes are not needed any more
    return out
