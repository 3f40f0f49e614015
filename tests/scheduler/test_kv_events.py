"""Schedulers publish their load and prefix-cache block hashes on Connect, for the frontends' routing."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from kvgrid.v1 import scheduler_pb2
from services.common.block_hash import prompt_block_hashes
from services.scheduler.block_pool import BlockPool
from services.scheduler.kv_events import KvEventLog
from services.scheduler.prefix_hash import extend_block_hashes
from tests.scheduler.harness import stack, submit_request
from tests.scheduler.test_connect import Frontend

pytestmark = pytest.mark.timeout(120)


def test_the_frontends_block_hashes_are_the_schedulers():
    tokens = list(range(1, 40))
    assert prompt_block_hashes(tokens, 8) == [h.value for h in extend_block_hashes([], tokens, 8)]
    assert len(prompt_block_hashes(tokens, 8)) == 4 and prompt_block_hashes(tokens[:7], 8) == []
    # ... computed in another process (a frontend) too.
    code = "from services.common.block_hash import prompt_block_hashes as h; print(h(list(range(1, 40)), 8))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert other.strip() == str(prompt_block_hashes(tokens, 8))


def test_the_pool_reports_stored_and_evicted_hashes_and_the_log_nets_them_per_hash():
    pool = BlockPool(2)
    log = KvEventLog()
    pool.on_event = log.record
    a, b = extend_block_hashes([], [1, 2, 3, 4], 2)
    blocks = pool.get_new_blocks(2)
    pool.cache_block(blocks[0], a)
    pool.cache_block(blocks[1], b)
    pool.free_blocks(reversed(blocks))
    load = scheduler_pb2.GroupLoad(num_running=1)
    assert log.take(load) == (load, False, {a.value: True, b.value: True})
    assert sorted(pool.cached_hashes()) == sorted([a.value, b.value])
    pool.get_new_blocks(1)  # evicts the tail of the prefix first (LRU)
    assert log.take(load) == (None, False, {b.value: False})  # the load did not change: not repeated
    log.reset(2)
    assert log.take(scheduler_pb2.GroupLoad()) == (scheduler_pb2.GroupLoad(), True, {})


def test_a_frontend_learns_the_load_and_every_cached_prefix_including_those_of_other_frontends():
    async def body():
        async with stack(worker_kw={"num_blocks": 64, "block_size": 4}) as s:
            a = Frontend(s.stub)
            await a.wait(lambda: a.messages)
            first = a.messages[0]
            assert first.kv_events.cleared and first.kv_events.block_size == 4 and first.HasField("load")
            prompt = list(range(1, 11))  # two full blocks of 4, and 2 tokens more
            await a.send([submit_request("r", prompt, max_tokens=3)])
            await a.wait(lambda: a.ended(["r"]))
            stored = set(prompt_block_hashes(prompt, 4))
            await a.wait(lambda: stored <= {h for m in a.messages for h in m.kv_events.stored})
            await a.wait(lambda: a.messages[-1].load.num_running == 0)
            # A frontend connecting later gets the whole cache in its first message.
            b = Frontend(s.stub)
            await b.wait(lambda: b.messages)
            assert b.messages[0].kv_events.cleared and stored <= set(b.messages[0].kv_events.stored)
            a.call.cancel()
            b.call.cancel()

    asyncio.run(asyncio.wait_for(body(), 100))


def test_a_big_snapshot_goes_out_over_several_messages_in_order(monkeypatch):
    from services.scheduler import frontends

    monkeypatch.setattr(frontends, "MAX_KV_EVENTS", 3)

    async def body():
        stream = frontends.FrontendStream("peer", lambda request_id: True)
        stream.publish(scheduler_pb2.GroupLoad(num_running=2), True, dict.fromkeys(range(7), True), 4)
        stream.publish(None, False, {1: False}, 4)  # evicted before it was sent: sent as removed, once
        messages = stream.messages()
        got = [await anext(messages) for _ in range(3)]
        assert [m.kv_events.cleared for m in got] == [True, False, False]
        assert got[0].load.num_running == 2 and not got[1].HasField("load")
        assert [list(m.kv_events.stored) for m in got] == [[0, 2], [3, 4, 5], [6]]
        assert [list(m.kv_events.removed) for m in got] == [[1], [], []]
        assert all(m.kv_events.block_size == 4 for m in got)

    asyncio.run(asyncio.wait_for(body(), 10))
