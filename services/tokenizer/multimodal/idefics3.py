"""Idefics3 (SmolVLM) image processing as its processor does it: the longest edge resized, then (with image
splitting) resized to whole tiles, cut into rows x cols tiles plus a global view, each rescaled and normalized;
and the prompt text that replaces the image token (a tile's placeholders after its <row_r_col_c> tag).

Resizes run on 8-bit images one after another, as transformers' PIL backend does."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image

MAX_IMAGE_SIZE = 4096  # transformers' absolute cap on a resized side
FAKE = "<fake_token_around_image>"
GLOBAL = "<global-img>"


def _longest_edge_size(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect)
        height += height % 2
    else:
        height = max_len
        width = int(height * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles_size(height: int, width: int, tile: int) -> tuple[int, int]:
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


def _resize(image: Image.Image, height: int, width: int, resample: int) -> Image.Image:
    return image if image.size == (width, height) else image.resize((width, height), resample=resample)


def tiles(image: Image.Image, settings: dict[str, Any]) -> tuple[np.ndarray, int, int]:
    """[T, 3, S, S] float32 tiles (row-major, then the global view; one tile when not split), rows and cols
    (0, 0 when not split)."""
    resample = int(settings.get("resample", 1))
    tile = int(settings.get("max_image_size", {"longest_edge": 364})["longest_edge"])
    if settings.get("do_convert_rgb", True) and image.mode != "RGB":
        image = image.convert("RGB")
    if settings.get("do_resize", True):
        size = settings.get("size", {"longest_edge": 4 * tile})
        if "longest_edge" in size:
            height, width = _longest_edge_size(image.height, image.width, int(size["longest_edge"]))
        else:
            height, width = int(size["height"]), int(size["width"])
        image = _resize(image, height, width, resample)
    views: list[Image.Image] = []
    rows = cols = 0
    if settings.get("do_image_splitting", True):
        image = _resize(image, *_whole_tiles_size(image.height, image.width, tile), resample)
        if image.height > tile or image.width > tile:
            rows, cols = (image.height - tile) // tile + 1, (image.width - tile) // tile + 1
            views = [
                image.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                for r in range(rows)
                for c in range(cols)
            ]
            image = _resize(image, tile, tile, resample)
        views.append(image)
    else:
        views.append(_resize(image, tile, tile, resample))
    out = np.stack([np.asarray(v).transpose(2, 0, 1) for v in views]).astype(np.float64)
    if settings.get("do_rescale", True):
        out = out * float(settings.get("rescale_factor", 1 / 255))
    out = out.astype(np.float32)
    if settings.get("do_normalize", True):
        mean = np.asarray(settings.get("image_mean", (0.5, 0.5, 0.5)), dtype=np.float32)[:, None, None]
        std = np.asarray(settings.get("image_std", (0.5, 0.5, 0.5)), dtype=np.float32)[:, None, None]
        out = (out - mean) / std
    return np.ascontiguousarray(out, dtype=np.float32), rows, cols


def prompt_text(rows: int, cols: int, image_token: str, seq_len: int) -> str:
    """What replaces one image token in the prompt (transformers' ``Idefics3Processor``)."""
    run = image_token * seq_len
    if rows == 0 and cols == 0:
        return f"{FAKE}{GLOBAL}{run}{FAKE}"
    text = ""
    for r in range(rows):
        for c in range(cols):
            text += f"{FAKE}<row_{r + 1}_col_{c + 1}>{run}"
        text += "\n"
    return text + f"\n{FAKE}{GLOBAL}{run}{FAKE}"
