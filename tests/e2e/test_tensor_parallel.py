"""``--tensor-parallel-size 2`` on CPU (gloo), each service its own process, on a tiny float32 Llama
whose 4 query / 2 KV heads split in two.

Greedy output over the e2e prompts equals tensor-parallel size 1 token for token. A rank killed
under streaming requests takes the worker down (rank 0 exits, its other ranks too); the scheduler
sees the stream fail UNAVAILABLE, and when a worker is back it re-handshakes and the requests finish
as if nothing had happened.
"""

from __future__ import annotations

import re
import subprocess

import grpc
import pytest

from tests.e2e.stack import pid_alive, wait_idle
from tests.e2e.test_equivalence import PROMPTS
from tests.faults.services import Services
from tests.faults.streams import Streams, greedy
from tests.worker.tiny import save_tiny_bytelevel_tokenizer, save_tiny_model

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 32
DOWN_TIMEOUT_S = 20


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    model = str(tmp_path_factory.mktemp("tp-model"))
    save_tiny_model(model, vocab_size=300, max_position_embeddings=512)  # the byte-level tokenizer has 263 ids
    save_tiny_bytelevel_tokenizer(model)
    stack = Services(
        tmp_path_factory.mktemp("tp"),
        args={
            "worker": ["--model", model, "--tensor-parallel-size", "2"],
            "scheduler": ["--model", model],
            "tokenizer": ["--model", model],
        },
    )
    try:
        yield stack.start_all()
    finally:
        stack.stop_all()


def generate_all(addr: str) -> list[list[int]]:
    requests = [greedy(i, MAX_TOKENS) for i in range(len(PROMPTS))]
    for request, prompt in zip(requests, PROMPTS, strict=True):
        request.prompt = prompt
    outcomes = Streams(addr, requests).wait()
    assert all(o.ok for o in outcomes), [(o.code, o.details) for o in outcomes]
    return [o.token_ids for o in outcomes]


def rank_pid(services: Services) -> int:
    """Rank 1's pid, from the latest worker start's log line."""
    return int(re.findall(r"rank pids 1 pid (\d+)", services.log("worker"))[-1])


def restart_worker(services: Services, *args: str) -> None:
    services.start("worker", *args)
    services.wait_serving("worker")
    services.wait_serving("tokenizer")


@pytest.fixture(scope="module")
def two_ranks(services) -> list[list[int]]:
    """Greedy tokens of the e2e prompts from the first worker, of two ranks."""
    return generate_all(services.addr("tokenizer"))


def test_a_killed_rank_takes_the_worker_down_and_the_scheduler_resumes_on_the_next(services, two_ranks):
    requests = [greedy(i, 200) for i in range(4)]
    streams = Streams(services.addr("tokenizer"), requests)
    assert streams.wait_tokens(3) == len(requests), "the streams should be mid-way when the rank dies"
    rank = rank_pid(services)
    subprocess.run(["kill", "-9", str(rank)], check=True)
    assert services.procs["worker"].wait(timeout=DOWN_TIMEOUT_S) == 1  # rank 0 went down with it
    assert f"worker-group rank 1 (pid {rank}) exited" in services.log("worker")
    restart_worker(services)  # two ranks again
    outcomes = streams.wait()
    assert all(o.ok for o in outcomes), [(o.code, o.details) for o in outcomes]
    scheduler_log = services.log("scheduler")
    assert re.search(r"the worker stream failed \((UNAVAILABLE|CANCELLED)", scheduler_log), scheduler_log[-3000:]
    assert "requests of the lost worker by recompute" in scheduler_log
    uninterrupted = Streams(services.addr("tokenizer"), [greedy(i, 200) for i in range(4)]).wait()
    assert [o.token_ids for o in outcomes] == [o.token_ids for o in uninterrupted]
    with grpc.insecure_channel(services.addr("scheduler")) as channel:
        stats = wait_idle(channel)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


def test_greedy_output_with_two_ranks_equals_one_rank(services, two_ranks):
    rank = rank_pid(services)
    worker = services.procs["worker"]
    worker.terminate()  # SIGTERM: rank 0 stops its ranks in order
    assert worker.wait(timeout=60) == 0
    assert not pid_alive(rank)
    restart_worker(services, "--tensor-parallel-size", "1")
    assert generate_all(services.addr("tokenizer")) == two_ranks
    assert len(set(map(tuple, two_ranks))) > 1, "the prompts should not all give the same tokens"
