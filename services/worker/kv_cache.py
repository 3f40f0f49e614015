"""The paged KV cache: one (key, value) tensor pair per layer, views into a single allocation."""

from __future__ import annotations

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
    cache = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]
