"""Images from where requests give them: a PIL image (offline), a `data:` URL of base64
PNG / JPEG / WebP bytes, or a `file://` path under the allowed local media folder (vLLM's
--allowed-local-media-path). Nothing is fetched over the network. Each is checked against the
pixel limit from its header, before its pixels are decoded; every failure is a ValueError
that names the problem. Decoded images are kept by their encoded bytes' hash (DECODED_CACHE_BYTES
of pixels, shared by every prompt of the process), so the same image sent again is not decoded
again: a cached image is shared, and nothing that reads it may change it."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from ember.multimodal.cache import BytesLRU

FORMATS = ("PNG", "JPEG", "WEBP")
DECODED_CACHE_BYTES = 64 << 20  # decoded images' pixels kept for the same bytes sent again


@dataclass(frozen=True)
class MediaLimits:
    max_pixels: int  # width x height of one image
    allowed_local_media_path: str | None = None  # file:// URLs must name a file under it


def load_image(source: Any, limits: MediaLimits) -> Any:
    """A PIL image from a PIL image, a data: URL or a file:// URL."""
    from PIL import Image

    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits)
        return source
    if not isinstance(source, str):
        raise ValueError(f"an image is a PIL image or a URL string; got {type(source).__name__}")
    if source.startswith("data:"):  # kept by the URL's text: the same URL again is not even base64-decoded
        key = _key(b"url", source.encode())
        return _decoded(key, limits) or _decode(_data_url_bytes(source), limits, "the data: URL's image", key)
    if source.startswith("file:"):  # kept by the file's bytes, which may change under the same name
        data = _local_file_bytes(source, limits)
        key = _key(b"file", data)
        return _decoded(key, limits) or _decode(data, limits, source[:200], key)
    if source.startswith(("http://", "https://")):
        raise ValueError("image URLs over http(s) are not fetched: ember has no --allowed-media-domains yet; send "
                         "the image as a data: URL (base64), or a file:// path under --allowed-local-media-path")
    raise ValueError(f"unsupported image URL {source[:40]!r}: send a data: URL (base64 PNG, JPEG or WebP) or a "
                     "file:// path under --allowed-local-media-path")


def _data_url_bytes(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise ValueError("an image data: URL must be base64: data:image/png;base64,<bytes>")
    media_type = header[len("data:"):-len(";base64")]
    if media_type and not media_type.startswith("image/"):
        raise ValueError(f"the data: URL's media type {media_type[:40]!r} is not an image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the image data: URL's payload is not valid base64") from None


def _local_file_bytes(url: str, limits: MediaLimits) -> bytes:
    if limits.allowed_local_media_path is None:
        raise ValueError("file:// image URLs are refused: start the server with --allowed-local-media-path DIR to "
                         "allow files under DIR")
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise ValueError(f"a file:// URL names a file on this machine; got host {parsed.netloc[:40]!r}")
    root = Path(limits.allowed_local_media_path).resolve()
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise ValueError(f"the image file {str(path)[:200]!r} is outside --allowed-local-media-path")
    if not path.is_file():
        raise ValueError(f"the image file {str(path)[:200]!r} does not exist")
    return path.read_bytes()


def _key(kind: bytes, data: bytes) -> bytes:
    """What a decoded image is kept by: the hash of a data: URL's text or of a file's bytes."""
    return hashlib.blake2b(data, digest_size=16, person=kind).digest()


def _decoded(key: bytes, limits: MediaLimits) -> Any:
    """The image decoded before from the source of `key`, or None."""
    image = DECODED.get(key)
    if image is not None:
        _check_pixels(image.size, limits)
    return image


def _decode(data: bytes, limits: MediaLimits, what: str, key: bytes) -> Any:
    """`data` decoded, and kept by `key`."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data), formats=FORMATS)
    except (UnidentifiedImageError, OSError, ValueError):
        raise ValueError(f"{what} cannot be decoded as PNG, JPEG or WebP") from None
    _check_pixels(image.size, limits)  # from the header, before the pixels are decoded
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError):
        raise ValueError(f"{what} is truncated or corrupt: its pixels cannot be decoded") from None
    DECODED.put(key, image)
    return image


def _pixel_bytes(image: Any) -> int:
    return image.width * image.height * len(image.getbands())


DECODED: BytesLRU[Any] = BytesLRU(DECODED_CACHE_BYTES, _pixel_bytes)


def _check_pixels(size: tuple[int, int], limits: MediaLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"the image is {width}x{height}: it has no pixels")
    if width * height > limits.max_pixels:
        raise ValueError(f"the image is {width}x{height} = {width * height} pixels, over the limit of "
                         f"{limits.max_pixels} (--max-image-pixels): send a smaller image")
