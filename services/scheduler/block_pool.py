"""The KV block pool: reference counts, the LRU free queue and the prefix-cache map.

Invariants:
- a block is in the free queue exactly when its ref_cnt is 0;
- a block with a hash is in ``_cached`` under that hash's value, and only one
  block per value is (a second block computing the same prefix stays uncached);
- a cached block keeps its hash (and stays findable) while free, until it is
  handed out again: eviction happens at allocation, from the queue's head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from services.scheduler.free_queue import FreeBlockQueue, KVCacheBlock
from services.scheduler.prefix_hash import BlockHash


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[int, KVCacheBlock] = {}
        self.num_evictions = 0
        # Told (hash value, True) when a prefix block becomes findable and (hash value, False) when it is evicted:
        # schedulers publish these to frontends for routing (KvEvents).
        self.on_event: Callable[[int, bool], None] | None = None
        # Called with a cached block about to lose its hash (it is being handed out again), e.g. to save it elsewhere.
        self.on_evict: Callable[[KVCacheBlock], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return sum(1 for block in self._cached.values() if block.ref_cnt == 0)

    def cached_hashes(self) -> list[int]:
        """Hash values of every findable prefix block."""
        return list(self._cached)

    def get_new_blocks(self, num: int) -> list[KVCacheBlock]:
        """``num`` blocks from the queue's head, each with ref_cnt 1; evicts their cached prefixes."""
        if num > self.free_queue.num_free:
            raise ValueError(f"asked for {num} blocks, {self.free_queue.num_free} free")
        out = []
        for _ in range(num):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block holding exactly this prefix block, verified against parent and tokens."""
        block = self._cached.get(block_hash.value)
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a holder to each block (prefix-cache hits), reviving free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block under its prefix hash (no-op if that prefix is cached already)."""
        if not self.enable_caching or block.block_hash is not None or block_hash.value in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash.value] = block
        if self.on_event is not None:
            self.on_event(block_hash.value, True)

    def free_blocks(self, ordered: Iterable[KVCacheBlock]) -> None:
        """Drop one holder from each block. Pass a request's blocks tail first: of the blocks that become
        free, cached ones go to the queue's tail in that order (LRU, the tail of a prefix is evicted before
        its head), uncached ones to the queue's head (reused first, nothing to lose)."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed more often than held")
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if self.on_evict is not None:
            self.on_evict(block)
        value = block.block_hash.value
        del self._cached[value]
        block.block_hash = None
        self.num_evictions += 1
        if self.on_event is not None:
            self.on_event(value, False)
