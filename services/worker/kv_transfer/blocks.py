"""Copying whole blocks between the paged KV cache and another block store, one copy per run of blocks.

The cache is one allocation ``[layers, 2 (K, V), num_blocks, block_size, kv_heads, head_dim]``
(``services.worker.kv_cache``), handed to the model as per-layer views. A store laid out the same way
(the host tier's slots) exchanges a run of consecutive blocks that lands on consecutive slots with one
strided copy: ``layers * 2`` contiguous spans of ``n`` blocks each, no index tensors, no temporary. A
block-major store (``[n, layers, 2, ...]``: each block contiguous, as a Redis value holds it) takes a
run with one copy too. Caches that are not one allocation (tests build them per layer) are copied per
layer, still one copy per run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V of [num_blocks, block_size, kv_heads, head_dim]


def block_shape(kv_caches: KvCaches) -> tuple[int, ...]:
    """Shape of one block across layers: [layers, 2, block_size, kv_heads, head_dim]."""
    return (len(kv_caches), 2, *kv_caches[0][0].shape[1:])


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, length)`` for each maximal run where both sides go up by one at a time."""
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def whole_cache(kv_caches: KvCaches) -> torch.Tensor | None:
    """The cache as the one tensor [layers, 2, num_blocks, ...] its per-layer views come from; None when they are
    not evenly spaced views of one storage."""
    k0, v0 = kv_caches[0]
    if any(t.shape != k0.shape or t.stride() != k0.stride() or t.dtype != k0.dtype for kv in kv_caches for t in kv):
        return None
    base = k0.untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != base for kv in kv_caches for t in kv):
        return None
    kv_stride = v0.storage_offset() - k0.storage_offset()
    layer_stride = kv_caches[1][0].storage_offset() - k0.storage_offset() if len(kv_caches) > 1 else 2 * kv_stride
    for layer, (k, v) in enumerate(kv_caches):
        expected = k0.storage_offset() + layer * layer_stride
        if k.storage_offset() != expected or v.storage_offset() != expected + kv_stride:
            return None
    shape = (len(kv_caches), 2, *k0.shape)
    return k0.as_strided(shape, (layer_stride, kv_stride, *k0.stride()), k0.storage_offset())


class CacheBlocks:
    """Block copies in and out of the paged cache; ``non_blocking``: device copies from and to pinned memory
    are queued on the current stream (ordered with the forward passes that read or overwrite the blocks)."""

    def __init__(self, kv_caches: KvCaches):
        self.kv_caches = kv_caches
        self.whole = whole_cache(kv_caches)
        self.device = kv_caches[0][0].device

    def read(self, block_ids: list[int], store: torch.Tensor, slots: list[int], non_blocking: bool = False) -> None:
        """Cache blocks ``block_ids`` into ``store`` [layers, 2, num_slots, ...] at ``slots``."""
        for b, s, n in runs(block_ids, slots):
            for dst, src in self._pairs(store, slice(s, s + n), slice(b, b + n)):
                dst.copy_(src, non_blocking=non_blocking)

    def write(self, block_ids: list[int], store: torch.Tensor, slots: list[int], non_blocking: bool = False) -> None:
        """``store`` [layers, 2, num_slots, ...] at ``slots`` into cache blocks ``block_ids``."""
        for s, b, n in runs(slots, block_ids):
            for src, dst in self._pairs(store, slice(s, s + n), slice(b, b + n)):
                dst.copy_(src, non_blocking=non_blocking)

    def read_blocks(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Cache blocks ``block_ids`` into ``out`` [n, layers, 2, ...] (block-major: each block contiguous)."""
        self.read(block_ids, out.permute(1, 2, 0, 3, 4, 5), list(range(len(block_ids))))

    def write_block(self, block_id: int, block: torch.Tensor) -> None:
        """One block [layers, 2, block_size, kv_heads, head_dim] (any device) into cache block ``block_id``."""
        self.write([block_id], block.unsqueeze(2), [0])

    def write_each(self, block_ids: list[int], blocks: list[torch.Tensor], map_fn: MapFn = map) -> None:
        """Each of ``blocks`` (CPU tensors [layers, 2, block_size, kv_heads, head_dim], as Redis values hold them)
        into its cache block. A CPU cache takes them with numpy copies, spread over threads by ``map_fn``: numpy
        copies on one thread with the GIL released, where a torch copy per block would wake the whole intra-op
        thread team for each block (and a torch copy on another thread would start a team of its own)."""
        if self.device.type != "cpu":
            for block_id, block in zip(block_ids, blocks, strict=True):
                self.write_block(block_id, block)
            return

        def write(pair: tuple[int, torch.Tensor]) -> None:
            block_id, block = pair
            for src, dst in self._pairs(block.unsqueeze(2), slice(0, 1), slice(block_id, block_id + 1)):
                np.copyto(_raw(dst), _raw(src))

        for _ in map_fn(write, zip(block_ids, blocks, strict=True)):
            pass

    def _pairs(self, store: torch.Tensor, at: slice, blocks: slice):
        """(store part, cache part) views to copy between: one pair for the whole cache, else two per layer."""
        if self.whole is not None:
            yield store[:, :, at], self.whole[:, :, blocks]
            return
        for layer, (k, v) in enumerate(self.kv_caches):
            yield store[layer, 0, at], k[blocks]
            yield store[layer, 1, at], v[blocks]


MapFn = Callable[[Callable, Iterable], Iterator]
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as numpy integers of its element size (bfloat16 has no numpy type; the bits are what moves)."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()
