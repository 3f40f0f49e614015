"""The tier copy path: blocks move between the paged cache and the host and Redis tiers as runs of whole blocks,
and come back bit for bit, whether block ids and slots run in order or are scattered."""

from __future__ import annotations

import pytest
import torch

from kvgrid.v1 import worker_pb2
from services.worker.kv_cache import allocate_kv_cache
from services.worker.kv_transfer import HostTier, KvTransfer, RedisTier, layout
from services.worker.kv_transfer.blocks import CacheBlocks, block_shape, runs

LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 48, 4, 2, 8


def random_cache(dtype: torch.dtype, one_allocation: bool):
    """The worker's cache (one allocation, per-layer views) or per-layer tensors, filled with random values."""
    if one_allocation:
        caches = allocate_kv_cache(LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, "cpu")
    else:
        shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        caches = [(torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)) for _ in range(LAYERS)]
    for k, v in caches:
        k.copy_(torch.randn(k.shape))
        v.copy_(torch.randn(v.shape))
    return caches


def block(caches, block_id: int) -> torch.Tensor:
    """Block ``block_id`` across layers as raw bytes: [layers, 2, ...] viewed as uint8."""
    return torch.stack([torch.stack((k[block_id], v[block_id])) for k, v in caches]).view(torch.uint8)


def snapshot(caches) -> list[torch.Tensor]:
    return [block(caches, b).clone() for b in range(NUM_BLOCKS)]


class Request:
    def __init__(self, num_computed_tokens: int):
        self.num_computed_tokens = num_computed_tokens
        self.num_scheduled_tokens = 1


def load_plan(targets: list[int], host_slots: list[int] = (), redis_keys: list[str] = ()) -> worker_pb2.NewRequest:
    """A new request whose first blocks (``targets``) are loaded from the tiers, its last block computed."""
    new = worker_pb2.NewRequest(request_id="r", block_ids=[*targets, 0], num_computed_tokens=len(targets) * BLOCK_SIZE)
    for i, target in enumerate(targets):
        if i < len(host_slots):
            new.kv_loads.add(block_id=target, host_slot=host_slots[i])
        else:
            new.kv_loads.add(block_id=target, redis_key=redis_keys[i - len(host_slots)])
    return new


def test_runs_pair_up_consecutive_ids_on_both_sides():
    assert runs([4, 5, 6, 9, 10, 11], [0, 1, 2, 3, 7, 8]) == [(4, 0, 3), (9, 3, 1), (10, 7, 2)]
    assert runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    assert runs([], []) == []


def test_the_worker_cache_is_seen_as_one_tensor_and_per_layer_caches_are_not():
    caches = random_cache(torch.float32, one_allocation=True)
    whole = CacheBlocks(caches).whole
    assert whole is not None and whole.shape == (LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    assert torch.equal(whole[2, 1, 5], caches[2][1][5]) and torch.equal(whole[1, 0], caches[1][0])
    assert CacheBlocks(random_cache(torch.float32, one_allocation=False)).whole is None


PATTERNS = {
    "in order": ([2, 3, 4, 5, 6], [10, 11, 12, 13, 14], [0, 1, 2, 3, 4]),
    "scattered": ([7, 1, 2, 19, 5], [20, 9, 10, 3, 0], [6, 2, 3, 0, 7]),
}


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("one_allocation", [True, False], ids=["one allocation", "per layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_tier_round_trip_is_bit_for_bit_and_touches_nothing_else(pattern, one_allocation, dtype):
    sources, targets, slots = PATTERNS[pattern]
    caches = random_cache(dtype, one_allocation)
    transfer = KvTransfer(caches, BLOCK_SIZE, host=HostTier(caches, 8))
    before = snapshot(caches)
    saves = [worker_pb2.KvTierBlock(block_id=b, host_slot=s) for b, s in zip(sources, slots, strict=True)]
    plan = worker_pb2.StepPlan(step_id=1, kv_saves=saves)
    transfer.check(plan)
    transfer.apply(plan, [])
    for b in sources:  # the blocks are handed to other requests and overwritten
        for k, v in caches:
            k[b].fill_(float("nan"))
            v[b].fill_(float("nan"))
    new = load_plan(targets, host_slots=slots)
    transfer.check(worker_pb2.StepPlan(step_id=2, new_requests=[new]))
    assert transfer._load(new, Request(new.num_computed_tokens)) == 0
    after = snapshot(caches)
    for source, target in zip(sources, targets, strict=True):
        assert torch.equal(after[target], before[source])
    untouched = set(range(NUM_BLOCKS)) - set(sources) - set(targets)
    assert all(torch.equal(after[b], before[b]) for b in untouched)


# 18 blocks: more than one MGET trip holds; a run in order, then scattered ids.
REDIS_SOURCES = [*range(2, 12), 40, 31, 35, 30, 44, 29, 33, 32]
REDIS_TARGETS = [*range(20, 28), 47, 12, 13, 1, 46, 45, 0, 15, 16, 17]


@pytest.mark.parametrize("one_allocation", [True, False], ids=["one allocation", "per layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_redis_tier_round_trip_is_bit_for_bit_in_the_stored_format(redis_server, one_allocation, dtype):
    caches = random_cache(dtype, one_allocation)
    client = redis_server.client()
    namespace = f"tiny|{dtype}"
    transfer = KvTransfer(caches, BLOCK_SIZE, redis=RedisTier(client, namespace, block_shape(caches), dtype))
    before = snapshot(caches)
    keys = [f"kvgrid:kv:{i:04x}" for i in range(len(REDIS_SOURCES))]
    saves = [worker_pb2.KvTierBlock(block_id=b, redis_key=k) for b, k in zip(REDIS_SOURCES, keys, strict=True)]
    transfer.apply(worker_pb2.StepPlan(step_id=1, kv_saves=saves), [])
    transfer.flush()
    for source, key in zip(REDIS_SOURCES, keys, strict=True):  # each value holds its block in the documented layout
        stored = layout.decode(client.get(key), key, namespace, block_shape(caches), dtype)
        assert torch.equal(stored.view(torch.uint8), before[source])
    new = load_plan(REDIS_TARGETS, redis_keys=keys)
    assert transfer._load(new, Request(new.num_computed_tokens)) == 0
    after = snapshot(caches)
    for source, target in zip(REDIS_SOURCES, REDIS_TARGETS, strict=True):
        assert torch.equal(after[target], before[source])
    untouched = set(range(NUM_BLOCKS)) - set(REDIS_TARGETS)
    assert all(torch.equal(after[b], before[b]) for b in untouched)


def test_a_redis_load_stops_at_the_first_missing_block_and_the_rest_is_computed(redis_server):
    caches = random_cache(torch.float32, one_allocation=True)
    client = redis_server.client()
    transfer = KvTransfer(caches, BLOCK_SIZE, redis=RedisTier(client, "ns", block_shape(caches), torch.float32))
    keys = [f"kvgrid:kv:{i}" for i in range(20)]
    saves = [worker_pb2.KvTierBlock(block_id=i, redis_key=k) for i, k in enumerate(keys)]
    transfer.apply(worker_pb2.StepPlan(step_id=1, kv_saves=saves), [])
    transfer.flush()
    before = snapshot(caches)
    client.delete(keys[17])  # in the second MGET trip
    new = load_plan(list(range(24, 44)), redis_keys=keys)
    request = Request(new.num_computed_tokens)
    assert transfer._load(new, request) == 3 * BLOCK_SIZE
    assert request.num_computed_tokens == 17 * BLOCK_SIZE and request.num_scheduled_tokens == 1 + 3 * BLOCK_SIZE
    after = snapshot(caches)
    assert all(torch.equal(after[24 + i], before[i]) for i in range(17))
