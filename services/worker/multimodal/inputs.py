"""A request's images as the worker holds them, and which of their rows a step's tokens take."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument


@dataclass(slots=True)
class ImageInput:
    mm_hash: str
    offset: int  # the first placeholder's position in the prompt
    length: int  # placeholder tokens = encoder output rows
    shape: tuple[int, ...]
    pixel_values: bytes  # float32, little-endian, in ``shape``

    @classmethod
    def from_proto(cls, rid: str, msg: common_pb2.MultiModalInput, num_prompt_tokens: int) -> ImageInput:
        shape = tuple(msg.shape)
        if not shape or len(msg.pixel_values) != 4 * int(np.prod(shape)):
            raise InvalidArgument("new_requests.mm_inputs", f"{rid}: pixel_values do not hold shape {list(shape)}")
        if not msg.mm_hash or msg.length == 0 or msg.offset + msg.length > num_prompt_tokens:
            raise InvalidArgument(
                "new_requests.mm_inputs", f"{rid}: an image needs a hash and placeholders within the prompt"
            )
        return cls(msg.mm_hash, msg.offset, msg.length, shape, msg.pixel_values)

    def pixels(self) -> torch.Tensor:
        array = np.frombuffer(self.pixel_values, dtype="<f4").reshape(self.shape)
        return torch.from_numpy(array.copy())


@dataclass(slots=True)
class ImageSlice:
    """Rows [start, start + count) of ``image``'s encoder output go to flat batch rows [row, row + count)."""

    image: ImageInput
    start: int
    count: int
    row: int


def step_slices(images: list[ImageInput], start: int, end: int, first_row: int) -> list[ImageSlice]:
    """The parts of ``images`` whose placeholders lie in positions [start, end), the request's tokens this step
    (their flat rows from ``first_row``). A chunked prefill may split an image's run: each step takes its part."""
    out = []
    for image in images:
        lo, hi = max(start, image.offset), min(end, image.offset + image.length)
        if lo < hi:
            out.append(ImageSlice(image, lo - image.offset, hi - lo, first_row + lo - start))
    return out
