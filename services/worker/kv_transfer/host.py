"""The host-memory KV tier: ``num_slots`` block-sized slots in (pinned, on CUDA) host memory, laid out like the cache
([layers, 2, num_slots, ...]) so that a run of blocks moves with one copy each way (``blocks.CacheBlocks``).

The scheduler owns the slot map (``services.scheduler.kv_tiers.HostIndex``); this only copies.
"""

from __future__ import annotations

import torch

from services.worker.kv_cache import lazily_zeroed
from services.worker.kv_transfer.blocks import CacheBlocks, KvCaches, block_shape


class HostTier:
    def __init__(self, kv_caches: KvCaches, num_slots: int):
        self.cache = CacheBlocks(kv_caches)
        layers, two, *rest = block_shape(kv_caches)
        k0 = kv_caches[0][0]
        shape = (layers, two, num_slots, *rest)  # [layers, 2, num_slots, block_size, kv_heads, head_dim]
        if k0.device.type == "cuda":
            self.slots = torch.empty(shape, dtype=k0.dtype, pin_memory=True)
        else:
            # Fresh pages from calloc, as the KV cache itself, never a torch.empty of the tier's size: that slows
            # every later model step on CPU, as the host side of benchmarks/kv_tiers_bench.py shows.
            self.slots = lazily_zeroed(shape, k0.dtype)
        self.bytes_per_block = k0[0].numel() * k0.element_size() * 2 * layers

    @property
    def num_slots(self) -> int:
        return self.slots.shape[2]

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        # Queued behind this step's earlier device work and ahead of the forward pass that may overwrite the blocks.
        self.cache.read(block_ids, self.slots, slots, non_blocking=True)

    def load(self, slots: list[int], block_ids: list[int]) -> None:
        self.cache.write(block_ids, self.slots, slots, non_blocking=True)
