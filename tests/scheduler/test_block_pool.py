"""The block pool from plain numbers: exact block ids and free-queue order after every call."""

from __future__ import annotations

import pytest

from services.scheduler.block_pool import BlockPool
from services.scheduler.prefix_hash import BlockHash, extend_block_hashes, hash_block_tokens


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_new_blocks_come_from_the_head_in_id_order():
    pool = BlockPool(6)
    assert pool.free_queue.block_ids() == [0, 1, 2, 3, 4, 5]
    assert ids(pool.get_new_blocks(2)) == [0, 1]
    assert ids(pool.get_new_blocks(3)) == [2, 3, 4]
    assert pool.free_queue.block_ids() == [5]
    assert pool.num_used_blocks == 5 and pool.usage == pytest.approx(5 / 6)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.free_queue.block_ids() == [5]  # a failed request takes nothing


def test_freed_uncached_blocks_go_to_the_head_cached_ones_to_the_tail():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)  # 0 1 2
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    pool.cache_block(a[0], h0)
    pool.cache_block(a[1], h1)
    pool.free_blocks(reversed(a))  # tail first: 2 (uncached) -> head; 1, 0 (cached) -> tail
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.num_used_blocks == 0 and pool.num_cached_free_blocks == 2
    # Allocation takes uncached blocks first; the cached prefix survives until it reaches the head.
    assert ids(pool.get_new_blocks(4)) == [2, 3, 4, 5]
    assert pool.get_cached_block(h0) is a[0] and pool.get_cached_block(h1) is a[1]
    assert ids(pool.get_new_blocks(1)) == [1]  # evicts the LRU cached block (the prefix's tail block)
    assert pool.get_cached_block(h1) is None and pool.get_cached_block(h0) is a[0]
    assert pool.num_evictions == 1 and a[1].block_hash is None


def test_a_hit_revives_a_free_block_from_the_middle_of_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    h = hash_block_tokens(None, [9])
    pool.cache_block(blocks[1], h)
    pool.free_blocks(blocks)
    assert pool.free_queue.block_ids() == [3, 2, 0, 1]
    hit = pool.get_cached_block(h)
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.free_queue.block_ids() == [3, 2, 0]
    pool.touch([hit])
    assert hit.ref_cnt == 2
    pool.free_blocks([hit])
    assert hit.ref_cnt == 1 and pool.free_queue.block_ids() == [3, 2, 0]
    pool.free_blocks([hit])
    assert pool.free_queue.block_ids() == [3, 2, 0, 1]


def test_freeing_more_often_than_held_is_caught():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.free_blocks([block])
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_a_hash_collision_is_not_a_hit():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    real = hash_block_tokens(None, [1, 2, 3])
    pool.cache_block(block, real)
    forged = BlockHash(real.value, None, (7, 7, 7))  # same hash value, other tokens
    assert pool.get_cached_block(forged) is None
    assert pool.get_cached_block(hash_block_tokens(None, [1, 2, 3])) is block


def test_one_block_per_prefix_and_no_caching_when_disabled():
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [5, 6])
    pool.cache_block(a, h)
    pool.cache_block(b, h)  # the same prefix computed twice: the second copy stays uncached
    assert b.block_hash is None and pool.get_cached_block(h) is a
    off = BlockPool(3, enable_caching=False)
    (c,) = off.get_new_blocks(1)
    off.cache_block(c, h)
    assert c.block_hash is None and off.get_cached_block(h) is None


def test_hashes_chain_over_full_blocks_only():
    a = extend_block_hashes([], [1, 2, 3, 4, 5], 2)
    assert len(a) == 2  # the partial block [5] is not hashed
    b = extend_block_hashes([], [9, 9, 3, 4], 2)
    assert a[1].token_ids == b[1].token_ids == (3, 4)
    assert a[1] != b[1]  # same tokens, different parent
    assert a[0] == hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2], ("lora-a",)) != a[0]
    grown = extend_block_hashes(a, [1, 2, 3, 4, 5, 6], 2)
    assert grown is a and len(a) == 3 and a[2].parent == a[1].value
