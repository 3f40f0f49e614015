"""32 concurrent streams of different lengths all finish, each exactly as it does alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import collect, wait_idle

pytestmark = pytest.mark.timeout(600)

NUM_STREAMS = 32
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "cats",
    "watch",
    "from",
    "an",
    "old",
    "red",
    "barn",
]


def request(i: int) -> generate_pb2.GenerateRequest:
    prompt = " ".join(WORDS[: 2 + i % len(WORDS)] * (1 + i % 3)) + f" ({i})"
    # ignore_eos: every stream runs to its own max_tokens, so lengths differ as planned
    sampling = common_pb2.SamplingParams(max_tokens=3 + (i * 7) % 26, ignore_eos=True)
    return generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling, request_id=f"batch-{i}")


def test_concurrent_streams_equal_the_same_requests_alone(channel, scheduler_channel):
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    requests = [request(i) for i in range(NUM_STREAMS)]
    alone = [collect(stub.Generate(r, timeout=120)) for r in requests]
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        together = list(pool.map(lambda r: collect(stub.Generate(r, timeout=300)), requests))
    for r, (text, ids, last), (text_alone, ids_alone, _) in zip(requests, together, alone, strict=True):
        assert len(ids) == r.sampling.max_tokens and last.finish_reason == "length"
        assert last.usage.completion_tokens == r.sampling.max_tokens
        assert last.request_id == r.request_id
        assert (ids, text) == (ids_alone, text_alone), r.request_id
    stats = wait_idle(scheduler_channel)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
