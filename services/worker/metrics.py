"""The worker's Prometheus series (names fixed by DESIGN §3)."""

from __future__ import annotations

from prometheus_client import Histogram

from services.common.metrics import STEP_BUCKETS, ServiceMetrics


class WorkerMetrics(ServiceMetrics):
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

    def watch_encoder_cache(self, cache) -> None:
        """A vision model's encoder cache (``multimodal.encoder_cache``), read at each scrape."""
        self._gauge("kvgrid_worker_encoder_cache_bytes", "Bytes of encoder outputs cached").labels(
            model=self.model
        ).set_function(lambda: cache.num_bytes)
        self._gauge(
            "kvgrid_worker_encoder_inputs_encoded", "Images (or tiles) run through the vision encoder since start"
        ).labels(model=self.model).set_function(lambda: cache.num_encoded)

    def set_profile(self, **kinds: int) -> None:
        for kind, value in kinds.items():
            self.profiled_memory.labels(model=self.model, kind=kind).set(value)

    def record_step(self, seconds: float, num_steps: int) -> None:
        """A plan's execute time: one of several decode steps counts as that many steps, each its share."""
        for _ in range(num_steps):
            self.step_seconds.observe(seconds / num_steps)
