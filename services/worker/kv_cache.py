"""The paged KV cache: one (key, value) tensor pair per layer, views into a single allocation."""

from __future__ import annotations

import math
import mmap

import numpy as np
import torch


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: k_cache, v_cache of [num_blocks, block_size, num_kv_heads, head_dim].

    Zero-filled, not empty: batched attention reads whole blocks and masks the slots past a
    request's length, and a masked probability of 0 times a NaN left in uninitialised memory
    would still be NaN.
    """
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if torch.device(device).type == "cpu":
        cache = lazily_zeroed(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros that cost nothing until touched: fresh anonymous pages, which the kernel zero-fills on first use,
    where ``torch.zeros`` writes every byte up front (seconds per GiB). Mapped here rather than through
    calloc: once a process has freed large blocks, malloc serves even a request of gigabytes from its heap,
    and calloc then writes the zeros itself. Unmapped when the tensor is freed."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy's allocator asks for large arrays
        pages.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(pages, dtype=np.uint8).reshape(*shape[:-1], shape[-1] * dtype.itemsize)
    return torch.from_numpy(raw).view(dtype)
