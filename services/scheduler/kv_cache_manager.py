"""Per-request block tables over the block pool: prefix lookup, slot allocation, freeing.

A request's block table is append-only while it holds it: block i covers token
positions [i*block_size, (i+1)*block_size). It is dropped whole when the request
finishes or is preempted.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.block_pool import BlockPool
from services.scheduler.free_queue import KVCacheBlock
from services.scheduler.prefix_hash import extend_block_hashes
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.enable_caching = pool.enable_caching
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each table are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}
        # Prefix-cache counters, in tokens (queries: tokens looked up; hits: tokens found).
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self._tables.get(request_id, [])

    def held_request_ids(self) -> list[str]:
        """Requests that hold a block table."""
        return list(self._tables)

    def block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._tables.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens and its length in tokens.

        Never the whole sequence: the last token is always computed, because its logits are needed.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_queried_tokens
        self.prefix_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the request's computed ones (and after
        ``computed_blocks``, a prefix-cache hit taken over here). False when the pool cannot, and then nothing
        changed. New blocks are appended to the request's table."""
        bs = self.block_size
        table = self._tables.get(request.request_id)
        held = len(table) if table is not None else 0
        end = request.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        if not computed_blocks and end <= held * bs:
            return True  # the decode fast path: the last block still has room
        num_needed = cdiv(end, bs) - held - len(computed_blocks)
        # Hit blocks that sit in the free queue stop being allocatable once taken.
        num_revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return False
        if table is None:
            table = self._tables[request.request_id] = []
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            # Hit blocks are cached already; never register them again.
            self._num_cached[request.request_id] = len(table)
        if num_needed > 0:
            table.extend(self.pool.get_new_blocks(num_needed))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose K/V are computed (call once a step's result is in).

        Under async scheduling ``num_computed_tokens`` also counts a step still in flight, whose last token may not
        be known yet: only known tokens are registered. The in-flight step writes their K/V before any later plan
        (the only kind that can read a registered block) runs, because the worker runs plans in order."""
        num_full = min(request.num_computed_tokens, len(request.all_token_ids)) // self.block_size
        start = self._num_cached.get(request.request_id, 0)
        if num_full <= start or not self.enable_caching:
            return
        table = self._tables.get(request.request_id)
        if not table:
            return
        num_full = min(num_full, len(table))
        extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size)
        for i in range(start, num_full):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_cached[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's whole block table, tail first (see BlockPool.free_blocks)."""
        table = self._tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        if table:
            self.pool.free_blocks(reversed(table))
