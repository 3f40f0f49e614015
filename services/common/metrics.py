"""Prometheus metrics of each service (names fixed by DESIGN §3), each in its own registry.

Each service builds its own ``*Metrics`` object with the model label bound, so a
process exports only its own series. prometheus-client metrics are thread- and
task-safe; handlers update them directly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler, SchedulerOutput

# LLM latencies span milliseconds (a decode step) to minutes (a long generation).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class _Metrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        self.model = model

    def _counter(self, name, doc, labels=()):
        return Counter(name, doc, ["model", *labels], registry=self.registry)

    def _gauge(self, name, doc, labels=()):
        return Gauge(name, doc, ["model", *labels], registry=self.registry)

    def _histogram(self, name, doc, buckets):
        return Histogram(name, doc, ["model"], buckets=buckets, registry=self.registry).labels(model=self.model)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics on its own HTTP port (scheduler and worker)."""
        start_http_server(port, addr=host, registry=self.registry)


class TokenizerMetrics(_Metrics):
    def __init__(self, model: str):
        super().__init__(model)
        self.requests = self._counter("kvgrid_requests", "Finished requests by status", ["status"])
        self.prompt_tokens = self._counter("kvgrid_prompt_tokens", "Prompt tokens").labels(model=model)
        self.generation_tokens = self._counter("kvgrid_generation_tokens", "Generated tokens").labels(model=model)
        self.ttft = self._histogram("kvgrid_time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = self._histogram("kvgrid_inter_token_latency_seconds", "Time between streamed tokens", ITL_BUCKETS)
        self.e2e = self._histogram(
            "kvgrid_e2e_request_latency_seconds", "Request latency, first byte in to last byte out", E2E_BUCKETS
        )

    def request_done(self, status: str) -> None:
        self.requests.labels(model=self.model, status=status).inc()


class SchedulerMetrics(_Metrics):
    def __init__(self, model: str):
        super().__init__(model)
        m = model
        self.num_running = self._gauge("kvgrid_num_requests_running", "Requests running").labels(model=m)
        self.num_waiting = self._gauge("kvgrid_num_requests_waiting", "Requests waiting").labels(model=m)
        self.kv_cache_usage = self._gauge("kvgrid_kv_cache_usage_ratio", "Used KV blocks / all").labels(model=m)
        self.kv_blocks_total = self._gauge("kvgrid_kv_blocks_total", "KV blocks in the pool").labels(model=m)
        self.preemptions = self._counter("kvgrid_num_preemptions", "Preemptions").labels(model=m)
        self.prefix_queries = self._counter(
            "kvgrid_prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        ).labels(model=m)
        self.prefix_hits = self._counter("kvgrid_prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(
            model=m
        )
        self.step_batch_tokens = self._histogram(
            "kvgrid_step_batch_tokens", "Tokens computed per step", BATCH_TOKEN_BUCKETS
        )
        self.schedule_seconds = self._histogram("kvgrid_schedule_seconds", "Time to plan one step", STEP_BUCKETS)
        self.queue_seconds = self._histogram(
            "kvgrid_request_queue_seconds", "Time from arrival to first schedule", TTFT_BUCKETS
        )
        # KV tiers beyond the device pool (--kv-tiers), by tier; names match KvTierStats' fields.
        self._kv_tier = {
            name: self._counter(f"kvgrid_kv_tier_{name}", doc, ["tier"])
            for name, doc in (
                ("lookup_tokens", "Prompt tokens looked up in a KV tier past the device prefix hit"),
                ("hit_tokens", "Prompt tokens found in a KV tier and loaded instead of computed"),
                ("saved_bytes", "Bytes planned to be saved to a KV tier"),
                ("loaded_bytes", "Bytes planned to be loaded from a KV tier"),
                ("failed_tokens", "Tokens planned as KV tier loads that were recomputed (a failed or missing load)"),
                ("lookup_failures", "KV tier lookups that failed (tier unreachable), counted as misses"),
            )
        }

    def kv_tier(self, name: str) -> Counter:
        return self._kv_tier[name]

    def record_plan(self, out: SchedulerOutput, schedule_seconds: float, block_size: int) -> None:
        """A plan about to be sent. One of several decode steps counts as that many steps, each with its share
        of the time, as the worker's step histogram counts them."""
        for _ in range(out.num_steps):
            self.schedule_seconds.observe(schedule_seconds / out.num_steps)
            self.step_batch_tokens.observe(out.total_num_scheduled_tokens)
        if out.preempted_ids:
            self.preemptions.inc(len(out.preempted_ids))
        if out.new_requests:
            now = time.monotonic()
            for new in out.new_requests:
                request = new.request
                if request.num_preemptions == 0:
                    self.queue_seconds.observe(now - request.arrival_time)
                    self.prefix_queries.inc(request.num_prompt_tokens)
                    self.prefix_hits.inc(new.num_computed_tokens - len(new.kv_loads) * block_size)

    def record_state(self, core: Scheduler) -> None:
        """The gauges after a step's result."""
        self.num_running.set(core.num_running)
        self.num_waiting.set(core.num_waiting)
        self.kv_cache_usage.set(core.kv.usage)


class WorkerMetrics(_Metrics):
    def __init__(self, model: str):
        super().__init__(model)
        self.step_seconds = self._histogram(
            "kvgrid_worker_step_seconds", "Forward + sample time per step", STEP_BUCKETS
        )
        self.num_blocks = self._gauge("kvgrid_worker_num_blocks", "KV blocks allocated").labels(model=model)
        self.model_load_seconds = self._gauge("kvgrid_worker_model_load_seconds", "Time to load the weights").labels(
            model=model
        )
        self.profiled_memory = self._gauge(
            "kvgrid_worker_profiled_memory_bytes", "Memory profile figures of the handshake", ["kind"]
        )
        self.kv_tier_saved_bytes = self._counter(
            "kvgrid_worker_kv_tier_saved_bytes", "Bytes copied out to a KV tier", ["tier"]
        )
        self.kv_tier_loaded_bytes = self._counter(
            "kvgrid_worker_kv_tier_loaded_bytes", "Bytes loaded from a KV tier into the device pool", ["tier"]
        )
        self.kv_tier_failures = self._counter(
            "kvgrid_worker_kv_tier_failures",
            "KV tier saves or loads that failed (the load is recomputed)",
            ["tier", "op"],
        )
        self.kv_tier_load_seconds = Histogram(
            "kvgrid_worker_kv_tier_load_seconds",
            "Time to load one step's blocks from a KV tier",
            ["model", "tier"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )

    def set_profile(self, **kinds: int) -> None:
        for kind, value in kinds.items():
            self.profiled_memory.labels(model=self.model, kind=kind).set(value)

    def record_step(self, seconds: float, num_steps: int) -> None:
        """A plan's execute time: one of several decode steps counts as that many steps, each its share."""
        for _ in range(num_steps):
            self.step_seconds.observe(seconds / num_steps)
