"""KV tiers through `kvgrid serve`: the flags reach scheduler and worker, tier hits show in GetStats and on
both /metrics pages, a second group (in-process, same model) loads what the stack wrote to Redis, the
stack's own Redis loads (fetched as their plans arrive) give the recomputed tokens, a bad value midway
included, and killing Redis under the running stack only turns hits into recompute."""

from __future__ import annotations

import grpc

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import collect, get_stats, running_stack, wait_idle
from tests.kv_tiers.groups import TINY, group, prompts, tiers_of, tokens
from tests.kv_tiers.test_tiers_offline import _request
from tests.observability.probes import scrape, wait_for


def generate(stub, prompt: list[int]) -> list[int]:
    sampling = common_pb2.SamplingParams(max_tokens=6, temperature=0)
    request = generate_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
    return collect(stub.Generate(request, timeout=120))[1]


def test_tiers_through_the_services(tiny_model, redis_server, reference, tmp_path):
    flags = [
        *("--model", tiny_model, "--dtype", "float32", "--max-model-len", "256"),
        *("--kv-cache-memory", TINY["kv_cache_memory"], "--num-threads", "1"),
        *("--kv-tiers", "host,redis", "--kv-host-memory", "1MiB", "--kv-redis-url", redis_server.url),
    ]
    batch = prompts(seed=11)
    with running_stack(tmp_path / "serve.log", flags) as stack, grpc.insecure_channel(stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        expected = reference(batch)
        for _ in range(2):  # the second round finds evicted prefixes in the host tier
            assert [generate(stub, p) for p in batch] == expected
        with grpc.insecure_channel(stack.scheduler_addr) as sched:
            stats = {t.tier: t for t in wait_idle(sched).kv_tiers}
        assert stats["host"].hit_tokens > 0 and stats["host"].loaded_bytes > 0
        assert stats["redis"].saved_bytes > 0
        scheduler_metrics = scrape(stack.ports["--scheduler-metrics-port"])
        assert scheduler_metrics.get("kvgrid_kv_tier_hit_tokens_total", tier="host") == stats["host"].hit_tokens
        worker_port = stack.ports["--worker-metrics-port"]
        assert scrape(worker_port).get("kvgrid_worker_kv_tier_loaded_bytes_total", tier="host") > 0
        wait_for(
            lambda: scrape(worker_port).get("kvgrid_worker_kv_tier_saved_bytes_total", tier="redis") > 0,
            30,
            "redis saves",
        )

        # Group B, a scheduler core and runner of the same model in this process, loads the stack's blocks.
        wait_for(lambda: len(redis_server.client().keys("kvgrid:kv:*")) == len(batch) * 9, 30, "redis keys")
        other = group(tiny_model, redis_server.url)
        assert tokens(other, batch) == expected
        assert tiers_of(other).counters["redis"].hit_tokens == len(batch) * 144

        redis_server.kill()
        more = prompts(seed=12)
        assert [generate(stub, p) for p in batch + more] == reference(batch + more)
        with grpc.insecure_channel(stack.scheduler_addr) as sched:
            redis_stats = {t.tier: t for t in get_stats(sched).kv_tiers}["redis"]
        assert redis_stats.lookup_failures >= 1
        assert scrape(worker_port).get("kvgrid_worker_kv_tier_failures_total", tier="redis") >= 1


def test_redis_loads_through_the_services_give_the_recomputed_tokens(tiny_model, redis_server, reference, tmp_path):
    flags = [
        *("--model", tiny_model, "--dtype", "float32", "--max-model-len", "256"),
        *("--kv-cache-memory", TINY["kv_cache_memory"], "--num-threads", "1"),
        *("--kv-tiers", "redis", "--kv-redis-url", redis_server.url),
    ]
    batch = prompts(seed=13)
    expected = reference(batch)
    client = redis_server.client()
    with running_stack(tmp_path / "serve.log", flags) as stack, grpc.insecure_channel(stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        assert [generate(stub, p) for p in batch] == expected  # written through as each finishes
        wait_for(lambda: len(client.keys("kvgrid:kv:*")) == len(batch) * 9, 30, "redis keys")
        # The third prompt evicted the first from the 20-block pool: all 9 of its full blocks come from Redis,
        # and the fifth is corrupted after the scheduler's lookup would find it: 4 load, 5 are computed.
        fifth = tiers_of(group(tiny_model, redis_server.url)).keys(_request(batch[0]), 5)[4]
        flipped = bytearray(client.get(fifth))
        flipped[-100] ^= 1
        client.set(fifth, bytes(flipped))
        assert [generate(stub, p) for p in batch] == expected
        with grpc.insecure_channel(stack.scheduler_addr) as sched:
            redis = {t.tier: t for t in wait_idle(sched).kv_tiers}["redis"]
        assert redis.hit_tokens >= 9 * 16 and redis.failed_tokens == 5 * 16
        worker_metrics = scrape(stack.ports["--worker-metrics-port"])
        assert worker_metrics.get("kvgrid_worker_kv_tier_loaded_bytes_total", tier="redis") >= 4 * 8192
        assert worker_metrics.get("kvgrid_worker_kv_tier_failures_total", tier="redis", op="rejected") == 1
