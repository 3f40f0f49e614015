"""Where an image may come from, and decoding it within the request's limits.

``data:`` URLs always; ``file://`` URLs and paths under ``--allowed-local-media-path`` only; ``http(s)``
only from ``--allowed-media-domains`` (off by default: a URL then is refused, never fetched). Every refusal is
an ``InvalidArgument`` naming the message part it came from.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass

from PIL import Image

from services.common.errors import InvalidArgument

DEFAULT_MAX_IMAGES = 4
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGE_BYTES = 10 * 2**20
FETCH_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class MediaPolicy:
    allowed_local_media_path: str = ""  # a directory; '' refuses local files
    allowed_media_domains: tuple[str, ...] = ()  # hosts http(s) URLs may name; () refuses them all
    max_images: int = DEFAULT_MAX_IMAGES  # per request
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width x height of one image, read before decoding
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one encoded image

    @classmethod
    def from_limits(cls, limits) -> MediaPolicy:
        """From the frontend's ``LimitsConfig`` flags."""
        return cls(
            limits.allowed_local_media_path,
            limits.media_domains(),
            limits.max_images(),
            limits.max_image_pixels,
            limits.max_image_bytes,
        )

    def read_url(self, url: str, field: str) -> bytes:
        """The bytes an image URL names."""
        if not isinstance(url, str) or not url:
            raise InvalidArgument(field, "an image_url needs a url")
        if url.startswith("data:"):
            return self._data_url(url, field)
        parsed = urllib.parse.urlparse(url)
        if parsed.scheme in ("http", "https"):
            return self._fetch(url, parsed.hostname or "", field)
        if parsed.scheme == "file" or (not parsed.scheme and url.startswith("/")):
            return self._local(urllib.parse.unquote(parsed.path) if parsed.scheme else url, field)
        raise InvalidArgument(field, f"unsupported image URL scheme {parsed.scheme!r} (use data:, file: or http(s):)")

    def _data_url(self, url: str, field: str) -> bytes:
        header, sep, payload = url.partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidArgument(field, "a data: URL of an image is data:<type>;base64,<data>")
        if len(payload) * 3 // 4 > self.max_image_bytes:
            raise InvalidArgument(field, f"the image is larger than {self.max_image_bytes} bytes")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgument(field, "the data: URL is not valid base64") from None

    def _local(self, path: str, field: str) -> bytes:
        root = self.allowed_local_media_path
        if not root:
            raise InvalidArgument(field, "local image files are off (start the server with --allowed-local-media-path)")
        real, real_root = os.path.realpath(path), os.path.realpath(root)
        if os.path.commonpath([real, real_root]) != real_root:
            raise InvalidArgument(field, "the image file is outside --allowed-local-media-path")
        if not os.path.isfile(real):
            raise InvalidArgument(field, "no such image file")
        if os.path.getsize(real) > self.max_image_bytes:
            raise InvalidArgument(field, f"the image is larger than {self.max_image_bytes} bytes")
        with open(real, "rb") as f:
            return f.read()

    def _fetch(self, url: str, host: str, field: str) -> bytes:
        if host.lower() not in self.allowed_media_domains:
            raise InvalidArgument(
                field,
                f"fetching images from {host or 'that URL'!r} is off (see --allowed-media-domains); send a data: URL",
            )
        try:
            with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as response:  # noqa: S310 - scheme checked
                data = response.read(self.max_image_bytes + 1)
        except OSError as exc:
            raise InvalidArgument(field, f"cannot fetch the image: {exc}") from None
        if len(data) > self.max_image_bytes:
            raise InvalidArgument(field, f"the image is larger than {self.max_image_bytes} bytes")
        return data

    def decode(self, data: bytes, field: str) -> Image.Image:
        """An image file's pixels; its size is checked from the header before any pixel is decoded."""
        if len(data) > self.max_image_bytes:
            raise InvalidArgument(field, f"the image is larger than {self.max_image_bytes} bytes")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
                self.check_size(image, field)
                image.load()
        except InvalidArgument:
            raise
        except Image.DecompressionBombError:  # Pillow's own cap, far past ours, met while reading the header
            raise InvalidArgument(
                field, f"the image has more pixels than the {self.max_image_pixels} allowed"
            ) from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise InvalidArgument(field, f"not a readable image ({_reason(exc)})") from None
        return image

    def check_size(self, image: Image.Image, field: str) -> None:
        width, height = image.size
        if width * height > self.max_image_pixels:
            raise InvalidArgument(
                field, f"the image is {width}x{height} pixels, more than the {self.max_image_pixels} allowed"
            )
        if width < 1 or height < 1:
            raise InvalidArgument(field, "the image is empty")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
