"""kill -9 of the worker under streaming requests, with the services run one process each.

A new worker started on the same address picks up every request where its stream
stopped: the client sees a pause, then the rest, token for token what an
uninterrupted run gives (greedy and seeded). With no worker back within
--worker-reconnect-timeout, every request fails UNAVAILABLE with a reason, and the
next worker finds no block in use.
"""

from __future__ import annotations

import grpc
import pytest

from tests.e2e.stack import wait_idle
from tests.faults.services import Services
from tests.faults.streams import Streams, greedy, seeded
from tests.procs import terminate

pytestmark = pytest.mark.timeout(900)

NUM_GREEDY = 12
NUM_SEEDED = 4
MAX_TOKENS = 24


def requests():
    return [greedy(i, MAX_TOKENS) for i in range(NUM_GREEDY)] + [
        seeded(i, MAX_TOKENS) for i in range(NUM_GREEDY, NUM_GREEDY + NUM_SEEDED)
    ]


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    stack = Services(tmp_path_factory.mktemp("worker-crash"))
    try:
        yield stack.start_all()
    finally:
        stack.stop_all()


@pytest.fixture(scope="module")
def reference(services) -> list[list[int]]:
    outcomes = Streams(services.addr("tokenizer"), requests()).wait()
    assert all(o.ok for o in outcomes), [(o.code, o.details) for o in outcomes]
    return [o.token_ids for o in outcomes]


@pytest.mark.slow  # the same path as test_serve_faults' restart under `kvgrid serve`, which `make test` runs
def test_a_killed_worker_s_requests_finish_on_the_next_worker_as_if_nothing_happened(services, reference):
    streams = Streams(services.addr("tokenizer"), requests())
    in_flight = streams.wait_tokens(3)
    assert in_flight > len(reference) // 2, "most streams should be mid-way when the worker dies"
    services.kill("worker")
    services.start("worker")
    outcomes = streams.wait()
    for i, outcome in enumerate(outcomes):
        assert outcome.ok, (i, outcome.code, outcome.details)
        assert outcome.token_ids == reference[i], f"request {i} differs from the uninterrupted run"
    with grpc.insecure_channel(services.addr("scheduler")) as channel:
        stats = wait_idle(channel)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
    assert "requests of the lost worker by recompute" in services.log("scheduler")


def test_without_a_worker_in_time_requests_fail_unavailable_and_no_block_leaks(services):
    # A scheduler that waits 2 s for a worker; the frontend reconnects to it by itself.
    terminate(services.procs["scheduler"], 30)
    services.start("scheduler", "--worker-reconnect-timeout", "2")
    services.wait_serving("tokenizer")
    streams = Streams(services.addr("tokenizer"), [greedy(i, 400) for i in range(8)])
    assert streams.wait_tokens(2) == 8
    services.kill("worker")
    for outcome in streams.wait():
        assert outcome.code == grpc.StatusCode.UNAVAILABLE, (outcome.code, outcome.details)
        assert "the worker was lost and no worker came back" in outcome.details
    services.start("worker")
    services.wait_serving("tokenizer")
    with grpc.insecure_channel(services.addr("scheduler")) as channel:
        stats = wait_idle(channel)
    assert stats.worker_ready and (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
