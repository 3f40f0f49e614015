"""Per-request block tables over the block pool: prefix lookup, slot allocation, freeing.

A request's block table is append-only while it holds it: block i covers token
positions [i*block_size, (i+1)*block_size). It is dropped whole when the request
finishes or is preempted.

With a sliding window (every layer of the model reads only the keys of the last ``sliding_window``
positions before a query), the blocks wholly before the window of a request's next token are freed
while it runs (vLLM's sliding-window manager does the same): their table entries become ``SLID_OUT``,
whose id (0) the worker is sent but never reads. Freeing at plan time is safe under async scheduling
too: a freed block is written only by a later plan, and the worker runs plans in order. Freed blocks
keep their prefix hashes, so the prefix cache stays correct: a hit is a chain of full blocks from the
start, each holding exactly its tokens' keys and values.
"""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.block_pool import BlockPool
from services.scheduler.free_queue import KVCacheBlock
from services.scheduler.prefix_hash import extend_block_hashes
from services.scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# A table entry whose block slid out of the window and went back to the pool; never in the pool itself.
SLID_OUT = KVCacheBlock(0)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, sliding_window: int = 0):
        self.pool = pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        # How many leading entries of each table are SLID_OUT.
        self._num_slid: dict[str, int] = {}
        self.enable_caching = pool.enable_caching
        self._tables: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each table are registered in the prefix cache.
        self._num_cached: dict[str, int] = {}
        # Prefix-cache counters, in tokens (queries: tokens looked up; hits: tokens found).
        self.prefix_queries = 0
        self.prefix_hits = 0

    def window_fits(self, num_step_tokens: int) -> bool:
        """Whether blocks slide out of the window and the pool holds what one request needs at any length: the
        blocks of a window before a step of ``num_step_tokens`` tokens, and of that step."""
        if not self.sliding_window:
            return False
        return cdiv(self.sliding_window - 1 + num_step_tokens, self.block_size) + 1 <= self.pool.num_blocks

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

    def _hash_blocks(self, request: Request) -> None:
        """Hash the request's full blocks not hashed yet: its tokens, its images' content in the blocks they cover,
        and its adapter as the chain's seed."""
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            mm_spans=request.mm_spans,
            salt=request.cache_salt,
        )

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request's tokens and its length in tokens.

        Never the whole sequence: the last token is always computed, because its logits are needed.
        """
        if not self.enable_caching or request.skip_prefix_cache:
            return [], 0
        self._hash_blocks(request)
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
        if table and self.sliding_window:
            self._free_slid_out(request, table)
        held = len(table) if table is not None else 0
        end = request.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        if not computed_blocks and end <= held * bs:
            return True  # the decode fast path: the last block still has room
        num_needed = cdiv(end, bs) - held - len(computed_blocks)
        # Hit blocks already behind the window of the first token to compute are never read: not taken.
        num_slid = 0
        if computed_blocks and self.sliding_window and table is None:
            first_token = request.num_computed_tokens + len(computed_blocks) * bs
            num_slid = min(max(first_token - self.sliding_window + 1, 0) // bs, len(computed_blocks))
        taken = computed_blocks[num_slid:]
        # Hit blocks that sit in the free queue stop being allocatable once taken.
        num_revived = sum(1 for block in taken if block.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return False
        if table is None:
            table = self._tables[request.request_id] = []
        if computed_blocks:
            self.pool.touch(taken)
            table.extend([SLID_OUT] * num_slid + list(taken))
            if num_slid:
                self._num_slid[request.request_id] = num_slid
            # Hit blocks are cached already; never register them again.
            self._num_cached[request.request_id] = len(table)
        if num_needed > 0:
            table.extend(self.pool.get_new_blocks(num_needed))
        return True

    def _free_slid_out(self, request: Request, table: list[KVCacheBlock]) -> None:
        """Free the blocks wholly before the window of the request's next token (position num_computed_tokens),
        oldest last: as whole tables, the tail of a cached prefix is evicted before its head."""
        first_needed = max(request.num_computed_tokens - self.sliding_window + 1, 0) // self.block_size
        start = self._num_slid.get(request.request_id, 0)
        if first_needed <= start:
            return
        slid = table[start:first_needed]
        table[start:first_needed] = [SLID_OUT] * len(slid)
        self.pool.free_blocks(reversed(slid))
        self._num_slid[request.request_id] = first_needed

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
        self._hash_blocks(request)
        for i in range(start, num_full):
            if table[i] is not SLID_OUT:  # freed before its tokens were known: nothing to register
                self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_cached[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's whole block table, tail first (see BlockPool.free_blocks)."""
        table = self._tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        num_slid = self._num_slid.pop(request.request_id, 0)
        if table:
            self.pool.free_blocks(reversed(table[num_slid:]))
