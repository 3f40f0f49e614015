"""The scheduler's Prometheus series (names fixed by DESIGN §3)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import Counter

from services.common.metrics import BATCH_TOKEN_BUCKETS, STEP_BUCKETS, TTFT_BUCKETS, ServiceMetrics

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler
    from services.scheduler.step_plan import SchedulerOutput


class SchedulerMetrics(ServiceMetrics):
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

        # LoRA adapters: vLLM's info gauge (labels name the adapters, the value is when it was set), and counts.
        self.lora_requests_info = self._gauge(
            "kvgrid_lora_requests_info",
            "Running and waiting LoRA adapters (comma-separated names); the value is the time it was set",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        self.lora_requests = self._gauge("kvgrid_lora_requests", "Requests per LoRA adapter", ["lora_name", "state"])
        self._lora_labels: set[tuple[str, str]] = set()

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
        if core.limits.max_loras:
            self.record_lora(core)

    def record_lora(self, core: Scheduler) -> None:
        counts: dict[tuple[str, str], int] = {}
        for state, requests in (("running", core.running), ("waiting", core.waiting)):
            for r in requests:
                if r.lora_name:
                    counts[(r.lora_name, state)] = counts.get((r.lora_name, state), 0) + 1
        for name, state in self._lora_labels - counts.keys():
            self.lora_requests.labels(model=self.model, lora_name=name, state=state).set(0)
        for (name, state), n in counts.items():
            self.lora_requests.labels(model=self.model, lora_name=name, state=state).set(n)
        self._lora_labels |= counts.keys()
        running = ",".join(sorted({n for n, s in counts if s == "running"}))
        waiting = ",".join(sorted({n for n, s in counts if s == "waiting"}))
        self.lora_requests_info.clear()
        self.lora_requests_info.labels(
            model=self.model,
            max_lora=str(core.limits.max_loras),
            running_lora_adapters=running,
            waiting_lora_adapters=waiting,
        ).set(time.time())
