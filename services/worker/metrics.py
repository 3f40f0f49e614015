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
            "Time a step spent loading its blocks from a KV tier (Redis: the rest of its fetch, the copies)",
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

    def spec_decode_recorder(self, method: str):
        """A callback counting one verified draft (vLLM's spec_decode series, by method)."""
        labels = {"model": self.model, "method": method}
        drafts = self._counter("kvgrid_spec_decode_num_drafts", "Verify steps of requests with proposals", ["method"])
        draft_tokens = self._counter("kvgrid_spec_decode_num_draft_tokens", "Proposed tokens", ["method"])
        accepted = self._counter("kvgrid_spec_decode_num_accepted_tokens", "Accepted proposed tokens", ["method"])
        per_pos = self._counter(
            "kvgrid_spec_decode_num_accepted_tokens_per_pos", "Accepted proposals by position", ["method", "position"]
        )
        drafts_c, draft_tokens_c, accepted_c = (c.labels(**labels) for c in (drafts, draft_tokens, accepted))
        positions: list = []

        def record(num_draft_tokens: int, num_accepted: int) -> None:
            drafts_c.inc()
            draft_tokens_c.inc(num_draft_tokens)
            accepted_c.inc(num_accepted)
            while len(positions) < num_accepted:
                positions.append(per_pos.labels(position=str(len(positions)), **labels))
            for child in positions[:num_accepted]:
                child.inc()

        return record

    def set_profile(self, **kinds: int) -> None:
        for kind, value in kinds.items():
            self.profiled_memory.labels(model=self.model, kind=kind).set(value)

    def record_step(self, seconds: float, num_steps: int) -> None:
        """A plan's execute time: one of several decode steps counts as that many steps, each its share."""
        for _ in range(num_steps):
            self.step_seconds.observe(seconds / num_steps)
