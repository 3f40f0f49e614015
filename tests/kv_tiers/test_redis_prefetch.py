"""Redis loads fetched ahead: a plan's fetch starts when it arrives (while the step before it runs), touches no
cache block until the plan's own step, and gives the same bytes and the same fallback as a load at the step."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvgrid.v1 import worker_pb2
from services.worker.kv_transfer import HostTier, KvTransfer, RedisTier
from services.worker.kv_transfer.blocks import block_shape
from services.worker.servicer import _fetching_ahead
from tests.kv_tiers.test_tier_copies import BLOCK_SIZE, NUM_BLOCKS, Request, load_plan, random_cache, snapshot


def filled_redis(redis_server, caches, keys: list[str], host_slots: int = 0) -> KvTransfer:
    """A transfer whose Redis holds cache blocks 0..len(keys)-1 under ``keys``."""
    tier = RedisTier(redis_server.client(), "ns", block_shape(caches), torch.float32)
    transfer = KvTransfer(caches, BLOCK_SIZE, host=HostTier(caches, host_slots) if host_slots else None, redis=tier)
    saves = [worker_pb2.KvTierBlock(block_id=i, redis_key=k) for i, k in enumerate(keys)]
    transfer.apply(worker_pb2.StepPlan(step_id=1, kv_saves=saves), [])
    transfer.flush()
    return transfer


def test_a_prefetch_touches_no_block_before_its_step_and_runs_after_the_saves_before_it(redis_server):
    """Plan 2 loads Redis blocks into blocks 30..39, which plan 1 (still running when plan 2 arrives) evicts to
    the host tier: the fetch completes first, plan 1's save still copies the old blocks, plan 2 gets Redis's."""
    caches = random_cache(torch.float32, one_allocation=True)
    keys = [f"kvgrid:kv:{i}" for i in range(10)]
    transfer = filled_redis(redis_server, caches, keys, host_slots=16)
    before = snapshot(caches)
    targets = list(range(30, 40))
    new = load_plan(targets, redis_keys=keys)
    plan2 = worker_pb2.StepPlan(step_id=2, new_requests=[new])
    fetches = transfer.prefetch(plan2)
    assert set(fetches) == {"r"}
    assert len(fetches["r"].result(timeout=30).blocks) == 10
    assert all(torch.equal(a, b) for a, b in zip(snapshot(caches), before, strict=True))  # fetched, not copied

    evict = [worker_pb2.KvTierBlock(block_id=b, host_slot=i) for i, b in enumerate(targets)]
    transfer.apply(worker_pb2.StepPlan(step_id=1, kv_saves=evict), [])
    request = Request(new.num_computed_tokens)
    request.request_id = "r"
    assert transfer.apply(plan2, [request], fetches) == 0
    after = snapshot(caches)
    assert all(torch.equal(after[t], before[i]) for i, t in enumerate(targets))
    back = load_plan([40, 41, 42], host_slots=[0, 5, 9])  # the host tier kept what the blocks held before
    assert transfer._load(back, Request(back.num_computed_tokens)) == 0
    assert [torch.equal(snapshot(caches)[40 + i], before[t]) for i, t in enumerate([30, 35, 39])] == [True] * 3


@pytest.mark.parametrize("prefetched", [True, False], ids=["prefetched", "at the step"])
def test_a_key_missing_midway_leaves_the_rest_to_compute_either_way(redis_server, prefetched):
    caches = random_cache(torch.float32, one_allocation=True)
    keys = [f"kvgrid:kv:{i}" for i in range(20)]
    transfer = filled_redis(redis_server, caches, keys)
    before = snapshot(caches)
    redis_server.client().delete(keys[17])  # in the second MGET trip
    new = load_plan(list(range(24, 44)), redis_keys=keys)
    plan = worker_pb2.StepPlan(step_id=2, new_requests=[new])
    request = Request(new.num_computed_tokens)
    request.request_id = "r"
    fetches = transfer.prefetch(plan) if prefetched else None
    assert transfer.apply(plan, [request], fetches) == 3 * BLOCK_SIZE
    assert request.num_computed_tokens == 17 * BLOCK_SIZE and request.num_scheduled_tokens == 1 + 3 * BLOCK_SIZE
    after = snapshot(caches)
    assert all(torch.equal(after[24 + i], before[i]) for i in range(17))
    assert all(torch.equal(after[b], before[b]) for b in range(44, NUM_BLOCKS))


def test_host_loads_are_not_fetched_and_a_plan_without_loads_fetches_nothing(redis_server):
    caches = random_cache(torch.float32, one_allocation=True)
    transfer = filled_redis(redis_server, caches, ["kvgrid:kv:a", "kvgrid:kv:b"], host_slots=4)
    mixed = load_plan([20, 21, 22], host_slots=[0], redis_keys=["kvgrid:kv:a", "kvgrid:kv:b"])
    fetches = transfer.prefetch(worker_pb2.StepPlan(step_id=1, new_requests=[mixed]))
    assert len(fetches["r"].result(timeout=30).blocks) == 2  # a and b, not the host slot
    assert transfer.prefetch(worker_pb2.StepPlan(step_id=2, new_requests=[load_plan([])])) == {}
    host_only = KvTransfer(caches, BLOCK_SIZE, host=HostTier(caches, 4))
    assert host_only.prefetch(worker_pb2.StepPlan(step_id=3, new_requests=[mixed])) == {}


class FakeCore:
    fetches_ahead = True

    def __init__(self):
        self.prefetched: list[int] = []
        self.arrived = {step: asyncio.Event() for step in (1, 2, 3)}

    def prefetch(self, plan):
        self.prefetched.append(plan.step_id)
        self.arrived[plan.step_id].set()
        return {"step": plan.step_id}


def test_the_next_plan_is_fetched_while_the_step_before_it_runs():
    """Plan 2's prefetch starts while plan 1 is still being executed (the consumer has not asked for plan 2);
    plans still come out in order, each with its own fetches."""

    async def run():
        core, seen = FakeCore(), []

        async def plans():
            for step in (1, 2, 3):
                yield worker_pb2.StepPlan(step_id=step)

        async for plan, fetches in _fetching_ahead(core, plans()):
            seen.append((plan.step_id, fetches["step"]))
            if plan.step_id == 1:  # "running" plan 1: plan 2 arrives and is prefetched meanwhile
                await asyncio.wait_for(core.arrived[2].wait(), 10)
        return seen, core.prefetched

    seen, prefetched = asyncio.run(run())
    assert seen == [(1, 1), (2, 2), (3, 3)] and prefetched == [1, 2, 3]


def test_a_stream_error_comes_after_the_plans_before_it_and_a_closed_consumer_stops_reading():
    async def failing():
        yield worker_pb2.StepPlan(step_id=1)
        raise ValueError("the stream broke")

    async def run_failing():
        seen = []
        with pytest.raises(ValueError, match="broke"):
            async for plan, _ in _fetching_ahead(FakeCore(), failing()):
                seen.append(plan.step_id)
        return seen

    assert asyncio.run(run_failing()) == [1]

    async def endless():
        step = 0
        while True:
            step += 1
            yield worker_pb2.StepPlan(step_id=1 + step % 3)
            await asyncio.sleep(0)

    async def run_closed():
        reading = _fetching_ahead(FakeCore(), endless())
        await anext(reading)
        await reading.aclose()  # the stream's task ends: the reader task goes with it
        await asyncio.sleep(0.05)
        return [t for t in asyncio.all_tasks() if t.get_name() == "worker-plan-reader"]

    assert asyncio.run(run_closed()) == []
