"""Faults under `kvgrid serve`: a killed worker is restarted and its requests finish as if nothing happened;
a short soak with a worker kill; SIGTERM drains in order while streams finish."""

from __future__ import annotations

import random
import signal
import time

import grpc
import pytest

from kvgrid.v1 import generate_pb2_grpc
from tests.e2e.stack import wait_idle
from tests.faults import soak
from tests.faults.serve_stack import GRACE_S, child_pid, kill_child, serve_stack
from tests.faults.streams import Streams, greedy, seeded

pytestmark = pytest.mark.timeout(900)

NUM_STREAMS = 16


def requests():
    # The greedy ones are the soak's prompts at its length: one uninterrupted run is the reference of both.
    greedy_ones = [greedy(i, soak.MAX_TOKENS) for i in range(soak.NUM_PROMPTS)]
    return greedy_ones + [seeded(i, soak.MAX_TOKENS) for i in range(soak.NUM_PROMPTS, NUM_STREAMS)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = serve_stack(tmp_path_factory.mktemp("serve-faults") / "serve.log").start()
    try:
        yield stack.wait_ready()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def reference(stack) -> list[list[int]]:
    outcomes = Streams(stack.addr, requests()).wait()
    assert all(o.ok for o in outcomes), [(o.code, o.details) for o in outcomes]
    return [o.token_ids for o in outcomes]


def idle_stats(stack):
    with grpc.insecure_channel(stack.scheduler_addr) as channel:
        return wait_idle(channel)


def test_serve_restarts_a_killed_worker_and_its_requests_finish_unchanged(stack, reference):
    streams = Streams(stack.addr, requests())
    assert streams.wait_tokens(3) > NUM_STREAMS // 2, "most streams should be mid-way when the worker dies"
    old = child_pid(stack, "worker")
    assert kill_child(stack, "worker") != old
    for i, outcome in enumerate(streams.wait()):
        assert outcome.ok, (i, outcome.code, outcome.details)
        assert outcome.token_ids == reference[i], f"request {i} differs from the uninterrupted run"
    assert "the worker was killed by signal SIGKILL; restarting it in 1s" in stack.log()
    stats = idle_stats(stack)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


def test_short_soak_with_a_worker_kill(stack, reference):
    rng = random.Random(15)
    planned = soak.plan(60, rng)
    runner = soak.Soak(stack.addr, reference[: soak.NUM_PROMPTS])
    counts = runner.run(planned, {rng.randrange(10, 40): lambda: kill_child(stack, "worker")})
    print("soak counts:", dict(sorted(counts.items())))
    assert not runner.problems, runner.problems[:10]
    assert sum(counts.values()) == 60 and counts["greedy:length"] > 0
    stats = idle_stats(stack)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


def test_sigterm_drains_streams_refuses_new_requests_and_stops_in_order(stack):
    streams = Streams(stack.addr, [greedy(i, 100) for i in range(8)])
    assert streams.wait_tokens(1) == 8
    stack.process.send_signal(signal.SIGTERM)
    refused = None
    with grpc.insecure_channel(stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        while refused is None and not all(o.done.is_set() for o in streams.outcomes):
            try:
                list(stub.Generate(greedy(99, 1), timeout=60))
            except grpc.RpcError as e:
                refused = e
            time.sleep(0.05)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert "shutting down" in refused.details()
    for i, outcome in enumerate(streams.wait()):
        assert outcome.ok and len(outcome.token_ids) == 100, (i, outcome.code, outcome.details)
    assert stack.process.wait(timeout=GRACE_S) == 0
    log = stack.log()
    order = [log.find(f"kvgrid serve: stopping the {name} (pid") for name in ("tokenizer", "scheduler", "worker")]
    assert -1 not in order and order == sorted(order)
