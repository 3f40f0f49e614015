"""A model whose every layer slides over a window: the scheduler frees the blocks behind each request's window
while it runs, so a long request holds a bounded number of blocks; the fake model checks every token reads back
each key of its window from blocks its request still holds, and that prefix-cache hits read back their tokens."""

from __future__ import annotations

from services.scheduler.kv_cache_manager import SLID_OUT
from tests.scheduler.core import VOCAB, Driver, make_request, make_scheduler
from tests.scheduler.fake_worker import generate

WINDOW = 8  # tokens: two blocks of 4


def held(s, request_id: str) -> list[int]:
    return [b.block_id for b in s.kv.blocks_of(request_id) if b is not SLID_OUT]


def test_blocks_behind_the_window_are_freed_as_the_request_advances():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8, sliding_window=WINDOW)
    d = Driver(s)
    prompt = list(range(100, 120))  # 20 tokens: three chunks of 8, 8 and 4
    s.add_request(make_request("a", prompt, max_tokens=12))
    d.step()
    assert s.kv.block_ids("a") == [0, 1]
    d.step()  # the second chunk's first query (position 8) reads keys from position 1: block 0 stays
    assert s.kv.block_ids("a") == [0, 1, 2, 3]
    d.step()  # position 16 reads from 9: blocks 0 and 1 (positions 0-7) go back to the pool
    table = s.kv.blocks_of("a")
    assert table[:2] == [SLID_OUT, SLID_OUT] and held(s, "a") == [2, 3, 4]
    assert s.kv.pool.blocks[0].ref_cnt == 0 and s.kv.pool.blocks[1].ref_cnt == 0
    assert {0, 1} <= set(s.kv.pool.free_queue.block_ids())
    for _ in range(6):
        d.step()
        assert len(held(s, "a")) <= 4  # a window of 8 reaches back at most 3 blocks, plus the block written
    assert d.run()["a"] == generate(prompt, 12, VOCAB)
    assert s.kv.pool.num_used_blocks == 0 and s.kv.held_request_ids() == []


def test_a_request_longer_than_the_whole_pool_runs_to_the_end():
    """28 blocks' worth of tokens through a pool of 5 blocks: only the window's blocks are ever held."""
    s = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=8, sliding_window=WINDOW)
    d = Driver(s)
    prompt = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5]
    s.add_request(make_request("long", prompt, max_tokens=100))
    peak = 0
    while s.has_work():
        d.step()
        peak = max(peak, s.kv.pool.num_used_blocks)
    assert d.outputs["long"] == generate(prompt, 100, VOCAB)
    assert peak <= 4 and s.num_preemptions == 0


def test_prefix_cache_hits_blocks_that_slid_out_of_a_finished_request():
    """Freed blocks keep their hashes: a later request with the same prefix finds all of them, and the fake model
    checks each hit reads back its tokens."""
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32, sliding_window=WINDOW)
    d = Driver(s)
    prefix = list(range(200, 224))  # 6 full blocks
    s.add_request(make_request("a", prefix, max_tokens=6))
    d.run()
    s.add_request(make_request("b", prefix + [1, 2, 3], max_tokens=6))
    out, _ = d.step()
    assert [(p.request.request_id, p.num_computed_tokens) for p in out.new_requests] == [("b", 24)]
    # Of the six hit blocks, the four behind the window of position 24 are not taken (nor held).
    assert s.kv.blocks_of("b")[:4] == [SLID_OUT] * 4 and len(held(s, "b")) == 3
    assert d.run()["b"] == generate(prefix + [1, 2, 3], 6, VOCAB)


def test_preempted_requests_resume_with_the_same_tokens():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=16, sliding_window=WINDOW)
    assert s.max_seq_len == 1024  # not capped by the pool: a window and a step fit in it
    d = Driver(s)
    prompts = {f"r{i}": [(i * 37 + j * 11) % 500 for j in range(9 + 5 * i)] for i in range(4)}
    for rid, prompt in prompts.items():
        s.add_request(make_request(rid, prompt, max_tokens=20))
    outputs = d.run()
    assert s.num_preemptions > 0
    for rid, prompt in prompts.items():
        assert outputs[rid] == generate(prompt, 20, VOCAB), rid
    assert s.kv.pool.num_used_blocks == 0
