"""Gathering device blocks out of the paged KV cache and scattering them back, all layers at once."""

from __future__ import annotations

import torch

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: K, V of [num_blocks, block_size, kv_heads, head_dim]


def block_shape(kv_caches: KvCaches) -> tuple[int, ...]:
    """Shape of one block across layers: [layers, 2, block_size, kv_heads, head_dim]."""
    return (len(kv_caches), 2, *kv_caches[0][0].shape[1:])


def gather(kv_caches: KvCaches, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """The blocks as [layers, 2, n, block_size, kv_heads, head_dim], into ``out`` (any device) if given."""
    k0 = kv_caches[0][0]
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    stacked = torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index))) for k, v in kv_caches])
    if out is None:
        return stacked
    out.copy_(stacked)
    return out


def scatter(kv_caches: KvCaches, block_ids: list[int], data: torch.Tensor) -> None:
    """Write ``data`` [layers, 2, n, block_size, kv_heads, head_dim] (any device) into the blocks."""
    k0 = kv_caches[0][0]
    index = torch.tensor(block_ids, dtype=torch.int64, device=k0.device)
    data = data.to(k0.device, non_blocking=True)
    for layer, (k, v) in enumerate(kv_caches):
        k.index_copy_(0, index, data[layer, 0])
        v.index_copy_(0, index, data[layer, 1])
