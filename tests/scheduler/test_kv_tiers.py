"""The deciding half of the KV tiers, in the pure scheduler: which blocks are saved where and loaded back.

The fake model copies blocks to and from its tier store exactly as the plan says (saves first, then
loads, then the forward pass) and checks that every token a plan counts as computed reads back the
right token: a save that runs after its block was reused, a load from a slot overwritten meanwhile, or
a key naming another prefix all fail that check.
"""

from __future__ import annotations

import pytest

from services.common import kv_keys
from services.scheduler.kv_tiers import HostIndex, KvTiers, RedisIndex
from services.scheduler.prefix_hash import hash_block_tokens
from services.scheduler.scheduler import Scheduler
from tests.scheduler.core import Driver, make_request, make_scheduler
from tests.scheduler.fake_worker import FakeModel
from tests.scheduler.test_async_scheduling import EOS, Run, reference, workload

BS = 4


class FakeRedis:
    """EXISTS over a fake model's tier store (what the fake worker saved under redis keys)."""

    def __init__(self, store: dict):
        self.store = store
        self.down = False
        self.num_calls = 0

    def pipeline(self, transaction: bool = False):
        return _Pipeline(self)


class _Pipeline:
    def __init__(self, redis: FakeRedis):
        self.redis, self.keys = redis, []

    def exists(self, key: str) -> None:
        self.keys.append(key)

    def execute(self) -> list[int]:
        self.redis.num_calls += 1
        if self.redis.down:
            raise ConnectionError("redis is down")
        return [int(("redis_key", key) in self.redis.store) for key in self.keys]


def with_tiers(s: Scheduler, model: FakeModel, host_slots: int = 0, redis: bool = False) -> KvTiers:
    tiers = KvTiers(
        BS,
        100,
        kv_keys.namespace("m", "float32", BS, 100),
        HostIndex(host_slots) if host_slots else None,
        RedisIndex(FakeRedis(model.tier_store)) if redis else None,
    )
    s.tiers = tiers
    s.kv.pool.on_evict = tiers.on_evict
    return tiers


def test_host_index_evicts_the_least_recently_used_unpinned_slot():
    hashes = [hash_block_tokens(None, [i] * BS) for i in range(4)]
    index = HostIndex(2)
    assert [index.put(h) for h in hashes[:2]] == [0, 1]
    assert index.put(hashes[0]) is None  # held already: only refreshed, now most recent
    assert index.put(hashes[2]) == 1 and index.find(hashes[1]) is None  # hashes[1] was least recent
    index.pin(hashes[0])
    assert index.put(hashes[3]) == 1 and index.find(hashes[2]) is None  # slot 0 is pinned: 1 is taken again
    index.pin(hashes[3])
    assert index.put(hashes[1]) is None  # every slot pinned: the save is skipped
    index.begin_plan()
    assert index.put(hashes[1]) == 0
    assert index.find(hash_block_tokens(None, [9] * BS)) is None


def test_an_evicted_prefix_is_saved_to_the_host_and_loaded_back_instead_of_computed():
    s = make_scheduler(num_blocks=4, block_size=BS, max_num_batched_tokens=64)
    driver = Driver(s)
    tiers = with_tiers(s, driver.model, host_slots=8)
    prompt = list(range(10, 19))  # 2 full blocks + 1 token
    s.add_request(make_request("a", prompt, max_tokens=1))
    driver.run()
    cached = [b.block_id for b in s.kv.pool.blocks if b.block_hash is not None]
    assert len(cached) == 2
    s.add_request(make_request("b", list(range(50, 63)), max_tokens=1))  # 4 blocks: evicts a's prefix
    out, _ = driver.step()
    # The tail of a prefix is evicted before its head (LRU), so it takes the first free slot.
    assert [(save.block_id, save.host_slot) for save in out.kv_saves] == [(cached[1], 0), (cached[0], 1)]
    driver.run()
    s.add_request(make_request("a2", prompt, max_tokens=1))
    out, _ = driver.step()
    (new,) = out.new_requests
    assert [load.host_slot for load in new.kv_loads] == [1, 0]
    assert [load.block_id for load in new.kv_loads] == new.block_ids[:2]
    assert (new.num_computed_tokens, new.num_scheduled_tokens) == (8, 1)
    assert tiers.counters["host"].hit_tokens == 8
    driver.run()
    assert driver.outputs["a2"] == driver.outputs["a"]


def test_finished_requests_are_written_through_to_redis_once_and_found_by_another_group():
    s = make_scheduler(num_blocks=16, block_size=BS)
    driver = Driver(s)
    tiers = with_tiers(s, driver.model, redis=True)
    prompt = list(range(10, 23))  # 3 full blocks + 1 token
    s.add_request(make_request("a", prompt, max_tokens=4))
    driver.run()
    saved = [key for kind, key in driver.model.tier_store if kind == "redis_key"]
    assert len(saved) == 4  # 17 tokens known, 16 computed: 4 full blocks
    assert tiers.counters["redis"].saved_bytes == 4 * 100
    s.add_request(make_request("a-again", prompt, max_tokens=4))
    driver.run()
    assert tiers.counters["redis"].saved_bytes == 4 * 100  # the same keys are not written twice

    other = make_scheduler(num_blocks=16, block_size=BS)
    other_driver = Driver(other)
    other_driver.model.tier_store = driver.model.tier_store  # one Redis, two groups
    other_tiers = with_tiers(other, other_driver.model, redis=True)
    other.add_request(make_request("b", prompt, max_tokens=4))
    out, _ = other_driver.step()
    (new,) = out.new_requests
    assert [load.redis_key for load in new.kv_loads] == saved[:3]  # never the last token's block
    assert new.num_computed_tokens == 12
    other_driver.run()
    assert other_driver.outputs["b"] == driver.outputs["a"]
    assert other_tiers.counters["redis"].hit_tokens == 12


def test_an_unreachable_redis_is_a_miss_and_is_left_alone_for_a_while():
    s = make_scheduler(num_blocks=16, block_size=BS)
    driver = Driver(s)
    tiers = with_tiers(s, driver.model, redis=True)
    tiers.redis.client.down = True
    prompt = list(range(10, 23))
    for i in range(3):
        s.add_request(make_request(f"r{i}", [i, *prompt], max_tokens=2))
    out, _ = driver.step()
    assert all(not new.kv_loads and new.num_computed_tokens == 0 for new in out.new_requests)
    assert tiers.counters["redis"].lookup_failures == 1  # then skipped until REDIS_RETRY_S passed
    driver.run()


def test_a_request_waiting_for_blocks_asks_redis_once():
    s = make_scheduler(num_blocks=6, block_size=BS)  # "long" holds every block until it ends
    driver = Driver(s)
    tiers = with_tiers(s, driver.model, redis=True)
    s.add_request(make_request("long", list(range(10, 30)), max_tokens=3))
    s.add_request(make_request("next", list(range(40, 55)), max_tokens=1))
    calls = []
    while s.has_work():
        driver.step()
        calls.append(tiers.redis.client.num_calls)
    assert calls[-1] == 2  # one lookup per admission, however many steps "next" waited
    assert len(calls) > 4


@pytest.mark.parametrize("depth", [1, 2], ids=["sync", "async"])
def test_tiers_give_the_unscheduled_tokens_under_preemption_aborts_and_async_scheduling(depth):
    requests = workload(seed=3, num_requests=200)
    s = make_scheduler(20, BS, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=60, eos=EOS)
    run = Run(s, depth, seed=5)
    tiers = with_tiers(s, run.model, host_slots=6, redis=True)
    run.go(requests, abort_rate=0.02)  # the fake model asserts that every loaded block holds the right tokens
    for request_id, prompt, stop in requests:
        expected = reference(prompt, **stop, max_seq_len=s.max_seq_len)
        got = run.outputs.get(request_id, [])
        assert got == (expected[: len(got)] if request_id in run.aborted else expected), request_id
    assert tiers.counters["host"].hit_tokens > 0 and tiers.counters["redis"].hit_tokens > 0
    assert s.kv.pool.num_used_blocks == 0
