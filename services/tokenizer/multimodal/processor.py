"""An image to the encoder's input, as the model's image processor does it (CLIP's: resize the shortest edge,
center crop, rescale, normalize), with Pillow and numpy, no torch. Settings are the processor config's own
(``preprocessor_config.json``), which the worker sends in the handshake."""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def _side(size: dict, key: str) -> int | None:
    value = size.get(key)
    return int(value) if value else None


def resize(image: Image.Image, size: dict, resample: int) -> Image.Image:
    width, height = image.size
    short = _side(size, "shortest_edge")
    if short:
        new = (short, int(short * height / width)) if width <= height else (int(short * width / height), short)
    elif _side(size, "height") and _side(size, "width"):
        new = (int(size["width"]), int(size["height"]))
    else:
        raise ValueError(f"image processor size {size} is not supported")
    return image if new == image.size else image.resize(new, resample=resample)


def center_crop(array: np.ndarray, height: int, width: int) -> np.ndarray:  # [C, H, W]
    _, h, w = array.shape
    if h < height or w < width:  # padded with zeros around, as transformers does
        out = np.zeros((array.shape[0], max(h, height), max(w, width)), dtype=array.dtype)
        top, left = (out.shape[1] - h) // 2, (out.shape[2] - w) // 2
        out[:, top : top + h, left : left + w] = array
        array, h, w = out, out.shape[1], out.shape[2]
    top, left = (h - height) // 2, (w - width) // 2
    return array[:, top : top + height, left : left + width]


def preprocess(image: Image.Image, settings: dict[str, Any]) -> np.ndarray:  # -> [3, H, W] float32
    if settings.get("do_convert_rgb", True) and image.mode != "RGB":
        image = image.convert("RGB")
    if settings.get("do_resize", True):
        image = resize(image, settings.get("size", {"shortest_edge": 224}), int(settings.get("resample", 3)))
    array = np.asarray(image).transpose(2, 0, 1)  # [3, H, W] uint8
    if settings.get("do_center_crop", "crop_size" in settings):
        crop = settings.get("crop_size", {"height": 224, "width": 224})
        array = center_crop(array, int(crop["height"]), int(crop["width"]))
    out = array.astype(np.float32)
    if settings.get("do_rescale", True):
        out = (array.astype(np.float64) * float(settings.get("rescale_factor", 1 / 255))).astype(np.float32)
    if settings.get("do_normalize", True):
        mean = np.asarray(settings.get("image_mean", OPENAI_CLIP_MEAN), dtype=np.float32)[:, None, None]
        std = np.asarray(settings.get("image_std", OPENAI_CLIP_STD), dtype=np.float32)[:, None, None]
        out = (out - mean) / std
    return np.ascontiguousarray(out, dtype=np.float32)
