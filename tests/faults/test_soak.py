"""The long soak (`make test-slow`): 500 requests while the worker is killed twice and the frontend once."""

from __future__ import annotations

import random

import grpc
import pytest

from tests.e2e.stack import wait_idle
from tests.faults import soak
from tests.faults.serve_stack import kill_child, serve_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

NUM_REQUESTS = 500


def test_soak_500_requests_with_two_worker_kills_and_a_frontend_kill(tmp_path):
    stack = serve_stack(tmp_path / "serve.log").start()
    try:
        stack.wait_ready()
        seed = random.randrange(2**32)
        print("soak seed:", seed)
        rng = random.Random(seed)
        refs = soak.references(stack.addr)
        planned = soak.plan(NUM_REQUESTS, rng)
        moments = rng.sample(range(NUM_REQUESTS // 10, NUM_REQUESTS * 9 // 10), 3)
        victims = ["worker", "worker", "tokenizer"]
        rng.shuffle(victims)
        chaos = {k: (lambda name=name: kill_child(stack, name)) for k, name in zip(moments, victims, strict=True)}
        runner = soak.Soak(stack.addr, refs)
        counts = runner.run(planned, chaos)
        print("soak kills after", dict(zip(moments, victims, strict=True)), "ended requests")
        print("soak counts:", dict(sorted(counts.items())))
        assert not runner.problems, runner.problems[:10]
        assert sum(counts.values()) == NUM_REQUESTS
        with grpc.insecure_channel(stack.scheduler_addr) as channel:
            stats = wait_idle(channel)
        assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
    finally:
        stack.stop()
