"""The step contract (``SchedulerCore``): built from a handshake's numbers, a plan out, sampled tokens back, and
what each step counts and records; no model, no gRPC."""

from __future__ import annotations

import pytest

from kvgrid.v1 import worker_pb2
from services.common.config import CacheConfig, Config, ModelConfig, SchedulerConfig
from services.scheduler.core import SchedulerCore, StepCounters
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.request import RequestStatus
from tests.scheduler.core import make_request

BS = 4
EOS = 2


def handshake(num_blocks: int = 8, **fields) -> worker_pb2.HandshakeResponse:
    fields = dict(max_model_len=64, vocab_size=100, max_num_batched_tokens=16, max_num_seqs=4) | fields
    return worker_pb2.HandshakeResponse(
        model="m",
        dtype="float32",
        block_size=BS,
        num_blocks=num_blocks,
        bytes_per_block=100,
        eos_token_ids=[EOS],
        **fields,
    )


def config(max_model_len: int = 0, num_scheduler_steps: int = 1, **cache) -> Config:
    return Config(
        model=ModelConfig(max_model_len=max_model_len),
        scheduler=SchedulerConfig(num_scheduler_steps=num_scheduler_steps, max_waiting_requests=10),
        cache=CacheConfig(block_size=BS, **cache),
    )


def sample(core: SchedulerCore, tokens: dict[str, list[int]], seconds: float = 0.01, failed: int = 0):
    """Plan a step and answer it with ``tokens`` (per request, one per decode step of the plan)."""
    out = core.plan()
    sampled = [(rid, token, None) for rid, ids in tokens.items() for token in ids]
    return out, core.finish_step(out, sampled, seconds, failed)


def series(metrics: SchedulerMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {"model": "m", **labels})


def test_for_worker_takes_the_tighter_of_both_sides_limits():
    core = SchedulerCore.for_worker(handshake(), config(max_model_len=32))
    s, a = core.scheduler, core.admission
    assert (s.limits.max_num_seqs, s.limits.max_num_batched_tokens, s.limits.max_model_len) == (4, 16, 32)
    assert (a.max_model_len, a.num_blocks, a.block_size, a.vocab_size, a.max_waiting_requests) == (32, 8, BS, 100, 10)
    assert (s.kv.pool.num_blocks, s.kv.block_size, s.eos_token_ids, s.tiers) == (8, BS, {EOS}, None)
    assert core.counters() == StepCounters()
    # Neither side gives a length: the pool's tokens.
    assert SchedulerCore.for_worker(handshake(max_model_len=0), config()).admission.max_model_len == 8 * BS


def test_a_step_appends_the_sampled_tokens_and_finishes_requests():
    core = SchedulerCore.for_worker(handshake(), config())
    s = core.scheduler
    s.add_request(make_request("a", [10, 11, 12, 13, 14], max_tokens=2))
    s.add_request(make_request("b", [20, 21, 22], max_tokens=5))
    a, b = s.requests["a"], s.requests["b"]

    out, results = sample(core, {"a": [50], "b": [60]})
    assert [(n.request.request_id, n.num_scheduled_tokens) for n in out.new_requests] == [("a", 5), ("b", 3)]
    assert [(r.request.request_id, r.token_id, r.finish) for r in results] == [("a", 50, None), ("b", 60, None)]
    assert a.all_token_ids == [10, 11, 12, 13, 14, 50] and b.all_token_ids == [20, 21, 22, 60]

    _, results = sample(core, {"a": [51], "b": [EOS]})
    assert [(r.request.request_id, r.token_id, r.finish) for r in results] == [
        ("a", 51, RequestStatus.FINISHED_LENGTH),
        ("b", EOS, RequestStatus.FINISHED_STOPPED),
    ]
    assert a.all_token_ids[-2:] == [50, 51] and b.all_token_ids[-2:] == [60, EOS]
    assert s.requests == {} and s.kv.pool.num_used_blocks == 0 and core.num_steps == 2
    # The worker drops their state with the next plan, which computes nothing.
    out = core.plan()
    assert (out.finished_ids, out.total_num_scheduled_tokens, out.new_requests, out.running) == (["a", "b"], 0, [], [])
    assert core.finish_step(out, [], 0.0) == [] and not s.has_work()


def test_a_plan_of_several_decode_steps_counts_as_that_many():
    core = SchedulerCore.for_worker(handshake(), config(num_scheduler_steps=4))
    s = core.scheduler
    s.add_request(make_request("a", [10, 11, 12], max_tokens=10))
    out, _ = sample(core, {"a": [50]})  # the prefill: one step
    assert out.num_steps == 1 and core.num_steps == 1

    out, results = sample(core, {"a": [51, 52, 53, 54]}, seconds=0.02)
    assert out.num_steps == 4 and core.num_steps == 5
    assert [r.token_id for r in results] == [51, 52, 53, 54]
    assert s.requests["a"].all_token_ids == [10, 11, 12, 50, 51, 52, 53, 54]
    # A decode-only plan's time, per step, sizes later plans.
    assert s.plan_steps.decode_step_seconds == pytest.approx(0.005)
    assert core.counters().num_steps == 5


def test_an_empty_plan_is_neither_counted_nor_recorded():
    metrics = SchedulerMetrics("m")
    core = SchedulerCore.for_worker(handshake(), config(), metrics)
    assert core.plan().is_empty
    assert core.num_steps == 0
    assert series(metrics, "kvgrid_schedule_seconds_count") == 0


def test_counters_count_preemptions_and_prefix_hits_and_sum_sessions():
    # 3 blocks of 4: two 4-token prompts take one block each; at the next step both need a second, and only one is
    # left, so the later one (fcfs) is preempted.
    core = SchedulerCore.for_worker(handshake(num_blocks=3), config())
    s = core.scheduler
    s.add_request(make_request("a", [10, 11, 12, 13], max_tokens=2))
    s.add_request(make_request("b", [20, 21, 22, 23], max_tokens=2))
    sample(core, {"a": [50], "b": [60]})
    out, results = sample(core, {"a": [51]})
    assert out.preempted_ids == ["b"] and results[0].finish is RequestStatus.FINISHED_LENGTH
    # b is admitted again: its first 4 tokens are found in the prefix cache, computed when it first ran.
    out, _ = sample(core, {"b": [61]})
    assert [(n.request.request_id, n.num_computed_tokens) for n in out.new_requests] == [("b", 4)]
    counters = core.counters()
    # Lookups count once per request, at its first admission.
    assert counters == StepCounters(num_steps=3, num_preemptions=1, prefix_cache_queries=8, prefix_cache_hits=0)

    s.add_request(make_request("c", [10, 11, 12, 13, 50, 7], max_tokens=1))  # a's prompt and first token: 1 block
    sample(core, {"c": [70]})
    assert core.counters() == StepCounters(4, 1, 14, 4)
    assert counters + core.counters() == StepCounters(7, 2, 22, 4)


def test_metrics_record_each_plan_and_the_state_after_each_step():
    metrics = SchedulerMetrics("m")
    core = SchedulerCore.for_worker(handshake(), config(num_scheduler_steps=3), metrics)
    s = core.scheduler
    s.add_request(make_request("a", [10, 11, 12, 13, 14], max_tokens=8))
    s.add_request(make_request("b", [10, 11, 12, 13, 15], max_tokens=1))
    out = core.plan()
    # The plan is recorded when it is made, the state only once its result is back.
    assert series(metrics, "kvgrid_step_batch_tokens_count") == 1
    assert series(metrics, "kvgrid_step_batch_tokens_sum") == 10
    assert series(metrics, "kvgrid_schedule_seconds_count") == 1
    assert series(metrics, "kvgrid_prefix_cache_queries_total") == 10
    assert series(metrics, "kvgrid_prefix_cache_hits_total") == 0  # a's block is computed in the same step
    assert series(metrics, "kvgrid_request_queue_seconds_count") == 2
    assert series(metrics, "kvgrid_num_requests_running") == 0

    core.finish_step(out, [("a", 50, None), ("b", 60, None)], 0.01)
    assert series(metrics, "kvgrid_num_requests_running") == 1
    assert series(metrics, "kvgrid_num_requests_waiting") == 0
    assert series(metrics, "kvgrid_kv_cache_usage_ratio") == pytest.approx(2 / 8)  # a: 6 tokens in 2 blocks

    sample(core, {"a": [51, 52, 53]})  # one plan of 3 decode steps: 3 steps of 1 token each
    assert series(metrics, "kvgrid_step_batch_tokens_count") == 4
    assert series(metrics, "kvgrid_step_batch_tokens_sum") == 13
    assert series(metrics, "kvgrid_schedule_seconds_count") == 4
    # 9 tokens, 8 of them computed (the last one sampled is not yet): 2 blocks.
    assert series(metrics, "kvgrid_kv_cache_usage_ratio") == pytest.approx(2 / 8)
    assert series(metrics, "kvgrid_num_preemptions_total") == 0


class EveryKey:
    """A Redis client that holds every key asked for (EXISTS in one pipeline)."""

    def __init__(self):
        self.keys: list[str] = []

    def pipeline(self, transaction: bool = False):
        return self

    def exists(self, key: str) -> None:
        self.keys.append(key)

    def execute(self) -> list[int]:
        keys, self.keys = self.keys, []
        return [1] * len(keys)


def test_failed_kv_tier_loads_are_counted_and_their_keys_written_again():
    metrics = SchedulerMetrics("m")
    tiers = dict(kv_tiers="redis", kv_redis_url="redis://127.0.0.1:1/0")
    core = SchedulerCore.for_worker(handshake(kv_tiers=["redis"]), config(**tiers), metrics)
    redis = core.scheduler.tiers.redis
    redis.client = EveryKey()  # the real client has not connected: construction does no I/O
    core.scheduler.add_request(make_request("a", list(range(10, 19)), max_tokens=4))
    out = core.plan()
    loads = out.kv_loads()
    assert len(loads) == 2 and all(redis.is_known(load.redis_key) for load in loads)
    assert out.new_requests[0].num_computed_tokens == 8 and out.total_num_scheduled_tokens == 1

    # The worker could not load them and computed the 8 tokens instead.
    results = core.finish_step(out, [("a", 50, None)], 0.01, num_kv_load_failed_tokens=8)
    assert [r.token_id for r in results] == [50]
    assert core.scheduler.tiers.counters["redis"].failed_tokens == 8
    assert series(metrics, "kvgrid_kv_tier_failed_tokens_total", tier="redis") == 8
    assert not any(redis.is_known(load.redis_key) for load in loads)  # written through again when a finishes
