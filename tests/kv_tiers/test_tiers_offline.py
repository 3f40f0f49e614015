"""KV tiers end to end in one process: the scheduler core plans, the worker's runner loads and saves real
tensors (float32, a tiny random Llama, a device pool small enough to evict), a real Redis in between.

Every check compares greedy tokens with a run that recomputes everything: a tier hit must give the same
tokens, byte for byte, and every fault must end in recompute, never in a wrong token or a failed request.
"""

from __future__ import annotations

from services.worker.kv_transfer import layout
from tests.kv_tiers.groups import group, prompts, tiers_of, tokens


def test_host_tier_hits_after_eviction_give_the_recomputed_tokens(tiny_model, reference):
    llm = group(tiny_model, None, "host", kv_host_memory="1MiB")
    batch = prompts(seed=1)
    for _ in range(3):  # each prompt evicts the others from the 20-block pool; rounds 2 and 3 load from host
        assert [tokens(llm, [p])[0] for p in batch] == reference(batch)
    host = tiers_of(llm).counters["host"]
    # At least one round's worth of prefixes came back from the host (the rest were still on the device).
    assert host.hit_tokens >= len(batch) * 144 and host.loaded_bytes == host.hit_tokens // 16 * 8192
    assert host.failed_tokens == 0


def test_group_b_loads_from_redis_what_group_a_computed(tiny_model, redis_server, reference):
    a = group(tiny_model, redis_server.url, "host,redis", kv_host_memory="1MiB")
    batch = prompts(seed=2)
    assert tokens(a, batch) == reference(batch)
    a.engine.core.kv_transfer.flush()
    assert len(redis_server.client().keys("kvgrid:kv:*")) == len(batch) * (155 // 16)
    b = group(tiny_model, redis_server.url)
    assert tokens(b, batch) == reference(batch)
    redis = tiers_of(b).counters["redis"]
    assert redis.hit_tokens == len(batch) * 144 and redis.failed_tokens == 0  # 9 of 9 full prompt blocks each


def test_corrupted_truncated_and_foreign_values_are_recomputed(tiny_model, redis_server, reference):
    a = group(tiny_model, redis_server.url)
    batch = prompts(seed=3, n=4)
    tokens(a, batch)
    a.engine.core.kv_transfer.flush()
    client = redis_server.client()
    b = group(tiny_model, redis_server.url)
    store = b.engine.core.kv_transfer.redis
    second = [tiers_of(b).keys(_request(p), 2)[1] for p in batch]  # each prompt's second block
    value = client.get(second[0])
    client.set(second[0], value[: len(value) // 2])  # truncated
    flipped = bytearray(client.get(second[1]))
    flipped[-100] ^= 1
    client.set(second[1], bytes(flipped))  # one bit of K/V corrupted
    block = layout.decode(client.get(second[2]), second[2], store.namespace, store.block_shape, store.dtype)
    client.set(second[2], layout.encode(second[2], "another-model|float32|bs=16|bytes=8192|layout=1", block))
    half = block[:, :, :8].contiguous()  # what a block size of 8 would have written
    client.set(second[3], layout.encode(second[3], store.namespace, half))

    assert tokens(b, batch) == reference(batch)
    redis = tiers_of(b).counters["redis"]
    assert redis.failed_tokens == 4 * (144 - 16)  # each load stops at its bad second block
    # Rejected values are dropped and written again, whole, once recomputed.
    b.engine.core.kv_transfer.flush()
    for key in second:
        layout.decode(client.get(key), key, store.namespace, store.block_shape, store.dtype)
    c = group(tiny_model, redis_server.url)
    assert tokens(c, batch) == reference(batch)
    assert tiers_of(c).counters["redis"].hit_tokens == 4 * 144 and tiers_of(c).counters["redis"].failed_tokens == 0


def test_redis_killed_mid_run_and_keys_lost_between_lookup_and_load(tiny_model, redis_server, reference):
    llm = group(tiny_model, redis_server.url)
    batch = prompts(seed=4)
    assert tokens(llm, batch) == reference(batch)
    llm.engine.core.kv_transfer.flush()
    redis_server.client().flushall()  # the keys are gone, but this scheduler still believes what it looked up
    redis_index = tiers_of(llm).redis
    real = redis_index.count_present
    redis_index.count_present = lambda keys: len(keys)  # a lookup that raced an eviction
    assert tokens(llm, batch) == reference(batch)
    counters = tiers_of(llm).counters["redis"]
    assert counters.failed_tokens == counters.hit_tokens >= 144  # every planned load failed and was computed
    redis_index.count_present = real
    redis_server.kill()
    more = prompts(seed=5)
    assert tokens(llm, batch + more) == reference(batch + more)  # lookups fail: misses, saves fail: dropped
    assert tiers_of(llm).counters["redis"].lookup_failures >= 1


def test_a_full_redis_refuses_writes_and_every_request_still_succeeds(tiny_model, reference):
    from tests.kv_tiers.redis_server import RedisServer

    server = RedisServer(extra_args=["--maxmemory-policy", "noeviction"]).start()
    try:
        client = server.client()
        room = 200 * 1024  # about 24 blocks of 8 KiB: less than the 36 the prompts write
        client.config_set("maxmemory", client.info("memory")["used_memory"] + room)
        llm = group(tiny_model, server.url)
        batch = prompts(seed=6, n=4)
        for _ in range(2):
            assert tokens(llm, batch) == reference(batch)
            llm.engine.core.kv_transfer.flush()
        stored = len(client.keys("kvgrid:kv:*"))
        assert 0 < stored < 4 * 9  # some writes were refused (OOM), the rest are served
    finally:
        server.stop()


def _request(prompt: list[int]):
    from services.scheduler.request import Request

    return Request("probe", list(prompt))
