"""Encoder outputs by image hash, bounded in bytes, least recently used out first.

An image is encoded once however many steps its placeholders span (a chunked prefill) and however
many requests show it. A miss is never an error: the requests that need an output carry the image's
pixels until their prompt is computed, so an evicted output is encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from services.worker.multimodal.inputs import ImageInput, ImageSlice

DEFAULT_CACHE_BYTES = 256 * 2**20


class EncoderCache:
    def __init__(self, encode: Callable[[torch.Tensor], torch.Tensor], device: torch.device, max_bytes: int):
        """``encode``: pixels [N, ...] -> [N, rows, E] (the model's ``encode_images``)."""
        self.encode = encode
        self.device = device
        self.max_bytes = max_bytes
        self._outputs: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_bytes = 0
        self.num_encoded = 0  # images run through the encoder (misses), for tests and metrics

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._outputs

    def get(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Every image's output [rows, E], encoding the missing ones in one batch per pixel shape."""
        found: dict[str, torch.Tensor] = {}
        missing: dict[tuple[int, ...], dict[str, ImageInput]] = {}
        for image in images:
            out = self._outputs.get(image.mm_hash)
            if out is not None:
                self._outputs.move_to_end(image.mm_hash)
                found[image.mm_hash] = out
            else:
                missing.setdefault(image.shape, {})[image.mm_hash] = image
        for group in missing.values():
            pixels = torch.stack([image.pixels() for image in group.values()]).to(self.device)
            outputs = self.encode(pixels.flatten(0, -4) if pixels.dim() > 4 else pixels)
            outputs = outputs.reshape(len(group), -1, outputs.shape[-1])  # tiles of one image are its rows in order
            for (mm_hash, image), out in zip(group.items(), outputs, strict=True):
                if out.shape[0] != image.length:
                    raise ValueError(
                        f"image {mm_hash[:12]}: the encoder gave {out.shape[0]} rows, {image.length} asked"
                    )
                found[mm_hash] = out
                self._put(mm_hash, out)
            self.num_encoded += len(group)
        return found

    def _put(self, mm_hash: str, out: torch.Tensor) -> None:
        size = out.numel() * out.element_size()
        if size > self.max_bytes:
            return
        self._outputs[mm_hash] = out
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, old = self._outputs.popitem(last=False)
            self.num_bytes -= old.numel() * old.element_size()

    def embed(self, embeds: torch.Tensor, slices: list[ImageSlice]) -> torch.Tensor:
        """``embeds`` [T, E] (the step's token embeddings) with the slices' encoder rows written in."""
        outputs = self.get(list({s.image.mm_hash: s.image for s in slices}.values()))
        for s in slices:
            embeds[s.row : s.row + s.count] = outputs[s.image.mm_hash][s.start : s.start + s.count]
        return embeds
