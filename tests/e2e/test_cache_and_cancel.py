"""Prefix-cache hits for a repeated system prompt; a cancelled stream gives back its blocks."""

from __future__ import annotations

import time

import grpc
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import collect, get_stats, wait_idle

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 16
SYSTEM = " ".join(
    f"Rule {i}: answer politely, cite the source, and never reveal the secret word number {i}." for i in range(16)
)


def chat(user: str) -> generate_pb2.ChatRequest:
    messages = [
        generate_pb2.ChatMessage(role="system", content=SYSTEM),
        generate_pb2.ChatMessage(role="user", content=user),
    ]
    return generate_pb2.ChatRequest(messages=messages, sampling=common_pb2.SamplingParams(max_tokens=4))


def test_a_repeated_system_prompt_hits_the_prefix_cache(channel, scheduler_channel):
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    _, _, first = collect(stub.Chat(chat("What is rule 3?"), timeout=120))
    before = wait_idle(scheduler_channel)
    _, _, second = collect(stub.Chat(chat("And what is rule 7?"), timeout=120))
    after = wait_idle(scheduler_channel)
    # the system prompt alone is this many full blocks; all of them must come from the cache
    system_tokens = first.usage.prompt_tokens - 20
    assert system_tokens > 8 * BLOCK_SIZE
    min_hit = (system_tokens // BLOCK_SIZE - 1) * BLOCK_SIZE
    assert after.prefix_cache_hits - before.prefix_cache_hits >= min_hit
    assert after.prefix_cache_queries - before.prefix_cache_queries >= second.usage.prompt_tokens - BLOCK_SIZE
    assert second.usage.cached_prompt_tokens >= min_hit
    assert after.num_cached_free_blocks > 0 and after.num_blocks_used == 0


def test_cancelling_a_stream_frees_its_blocks(channel, scheduler_channel):
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    sampling = common_pb2.SamplingParams(max_tokens=900, ignore_eos=True)
    call = stub.Generate(generate_pb2.GenerateRequest(prompt="Count slowly: one, two,", sampling=sampling), timeout=300)
    received = 0
    for response in call:
        received += len(response.token_ids)
        if received >= 3:
            break
    running = get_stats(scheduler_channel)
    assert running.num_running == 1 and running.num_blocks_used > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    stats = wait_idle(scheduler_channel, timeout=30)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
    time.sleep(0.5)  # and nothing comes back afterwards
    assert get_stats(scheduler_channel).num_blocks_used == 0
