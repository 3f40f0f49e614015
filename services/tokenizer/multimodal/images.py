"""A request's images, from its message parts to the worker's inputs: read, decode, process, hash, and the
placeholder token each image has in the prompt expanded to the run of tokens its encoder output fills.

Chat content parts (OpenAI's, and the offline/gRPC forms): ``{"type": "text", "text": ...}``,
``{"type": "image_url", "image_url": {"url": ...}}``, ``{"type": "image_pil", "image_pil": PIL.Image}`` and
``{"type": "image", "image": bytes | PIL.Image}``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.tokenizer.multimodal import idefics3
from services.tokenizer.multimodal.media import MediaPolicy
from services.tokenizer.multimodal.processor import preprocess

IMAGE_PART_TYPES = ("image_url", "image_pil", "image")


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """What the served model wants (the worker's handshake ``multimodal_config``)."""

    image_token: str
    image_token_id: int
    num_image_tokens: int  # placeholders per encoder input (an image, or an Idefics3 tile)
    processor: dict[str, Any]
    kind: str = "llava"  # or "idefics3": images split into tiles, each with its own placeholder run

    @classmethod
    def from_json(cls, text: str) -> ImageSpec | None:
        if not text:
            return None
        d = json.loads(text)
        return cls(d["image_token"], d["image_token_id"], d["num_image_tokens"], d["image_processor"], d["kind"])


@dataclass(frozen=True, slots=True)
class ImageSource:
    field: str  # the part it came from, for errors: messages[0].content[1]
    value: Any  # a URL, encoded bytes, or a PIL image


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def text_of(content: Any) -> str:
    """A message's text: its content, or its text parts joined."""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def split_images(messages: list[dict], field: str) -> tuple[list[dict], list[ImageSource]]:
    """Messages whose list contents hold ``{"type": "image"}`` stand-ins where images were (text parts kept), and
    the images in prompt order."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            where = f"{field}[{i}].content[{j}]"
            if is_image_part(part):
                kind = part["type"]
                value = part.get(kind)
                if kind == "image_url" and isinstance(value, dict):
                    value = value.get("url")
                images.append(ImageSource(part.get("field", where) if kind == "image" else where, value))
                parts.append({"type": "image"})
            elif isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise InvalidArgument(where, "a content part is {'type': 'text', 'text': ...} or an image_url part")
        out.append({**message, "content": parts})
    return out, images


def for_template(messages: list[dict], image_token: str, takes_parts: bool) -> list[dict]:
    """Messages as the chat template reads them: list contents kept for a template that iterates parts, else one
    string each with the image token where each image was (placeholders first, as vLLM writes them)."""
    if takes_parts:
        return messages
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            tokens = [image_token for p in content if p["type"] == "image"]
            text = text_of(content)
            content = "\n".join([*tokens, text]) if tokens else text
        out.append({**message, "content": content})
    return out


def template_takes_parts(source: str) -> bool:
    """Whether a chat template reads list contents (it looks at each part's type)."""
    return any(s in source for s in ("['type']", '["type"]', ".type ", ".type==", ".type =="))


@dataclass(slots=True)
class ProcessedImage:
    field: str
    pixels: np.ndarray  # float32: the encoder's input [3, H, W], or Idefics3's tiles [T, 3, S, S]
    mm_hash: str
    rows: int = 0  # Idefics3's tile grid (0 x 0: one view)
    cols: int = 0


class ImageInputs:
    """Reads and processes images for one served model within one policy."""

    def __init__(self, spec: ImageSpec | None, policy: MediaPolicy):
        self.spec = spec
        self.policy = policy

    def process(self, sources: list[ImageSource]) -> list[ProcessedImage]:
        if not sources:
            return []
        if self.spec is None:
            raise InvalidArgument(sources[0].field, "the served model takes text only, no images")
        if len(sources) > self.policy.max_images:
            raise InvalidArgument(
                sources[self.policy.max_images].field,
                f"{len(sources)} images in one request, more than the {self.policy.max_images} allowed",
            )
        return [self._one(source) for source in sources]

    def _one(self, source: ImageSource) -> ProcessedImage:
        value, field = source.value, source.field
        if isinstance(value, Image.Image):
            self.policy.check_size(value, field)
            image = value
        elif isinstance(value, bytes | bytearray):
            image = self.policy.decode(bytes(value), field)
        elif isinstance(value, str):
            image = self.policy.decode(self.policy.read_url(value, field), field)
        else:
            raise InvalidArgument(field, f"an image is a URL, bytes or a PIL image, got {type(value).__name__}")
        rows = cols = 0
        try:
            if self.spec.kind == "idefics3":
                pixels, rows, cols = idefics3.tiles(image, self.spec.processor)
            else:
                pixels = preprocess(image, self.spec.processor)
        except (OSError, ValueError) as exc:
            raise InvalidArgument(field, f"cannot process the image ({exc})") from None
        digest = hashlib.blake2b(pixels.tobytes(), digest_size=16)
        digest.update(repr(pixels.shape).encode())
        return ProcessedImage(field, pixels, digest.hexdigest(), rows, cols)

    def expand(self, ids: list[int], images: list[ProcessedImage], field: str, encode=None) -> tuple[list[int], list]:
        """The prompt with each image token expanded to the image's run of placeholders, and the worker's inputs.
        ``encode`` (text -> ids, no special tokens added) writes Idefics3's tile tags."""
        spec = self.spec
        if spec.kind == "idefics3":
            return self._expand_tiles(ids, images, field, encode)
        positions = self._image_tokens(ids, len(images), field)
        out: list[int] = []
        inputs = []
        last = 0
        for position, image in zip(positions, images, strict=True):
            out += ids[last:position]
            inputs.append(
                common_pb2.MultiModalInput(
                    pixel_values=image.pixels.astype("<f4").tobytes(),
                    shape=list(image.pixels.shape),
                    mm_hash=image.mm_hash,
                    offset=len(out),
                    length=spec.num_image_tokens,
                )
            )
            out += [spec.image_token_id] * spec.num_image_tokens
            last = position + 1
        out += ids[last:]
        return out, inputs

    def _image_tokens(self, ids: list[int], num_images: int, field: str) -> list[int]:
        spec = self.spec
        positions = [i for i, token in enumerate(ids) if token == spec.image_token_id]
        if len(positions) != num_images:
            raise InvalidArgument(
                field, f"{len(positions)} image placeholders ({spec.image_token}) in the prompt for {num_images} images"
            )
        return positions

    def _expand_tiles(self, ids: list[int], images: list[ProcessedImage], field: str, encode) -> tuple[list, list]:
        spec = self.spec
        positions = self._image_tokens(ids, len(images), field)
        out: list[int] = []
        inputs = []
        last = 0
        for position, image in zip(positions, images, strict=True):
            out += ids[last:position]
            start = len(out)
            out += encode(idefics3.prompt_text(image.rows, image.cols, spec.image_token, spec.num_image_tokens))
            runs = [i for i in range(start, len(out)) if out[i] == spec.image_token_id and out[i - 1] != out[i]]
            if len(runs) != len(image.pixels):
                raise ValueError(f"{len(runs)} placeholder runs for {len(image.pixels)} tiles")
            for k, (offset, tile) in enumerate(zip(runs, image.pixels, strict=True)):
                inputs.append(
                    common_pb2.MultiModalInput(
                        pixel_values=tile.astype("<f4").tobytes(),
                        shape=list(tile.shape),
                        mm_hash=f"{image.mm_hash}.{k}",
                        offset=offset,
                        length=spec.num_image_tokens,
                    )
                )
            last = position + 1
        out += ids[last:]
        return out, inputs
