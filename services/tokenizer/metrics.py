"""The tokenizer's Prometheus series (names fixed by DESIGN §3)."""

from __future__ import annotations

from services.common.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS, ServiceMetrics


class TokenizerMetrics(ServiceMetrics):
    def __init__(self, model: str):
        super().__init__(model)
        self.requests = self._counter("kvgrid_requests", "Finished requests by status", ["status"])
        self.prompt_tokens = self._counter("kvgrid_prompt_tokens", "Prompt tokens").labels(model=model)
        self.generation_tokens = self._counter("kvgrid_generation_tokens", "Generated tokens").labels(model=model)
        self.ttft = self._histogram("kvgrid_time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = self._histogram(
            "kvgrid_inter_token_latency_seconds",
            "Time per output token after the first (a gap shared by its tokens)",
            ITL_BUCKETS,
        )
        self.e2e = self._histogram(
            "kvgrid_e2e_request_latency_seconds", "Request latency, first byte in to last byte out", E2E_BUCKETS
        )

    def request_done(self, status: str) -> None:
        self.requests.labels(model=self.model, status=status).inc()
