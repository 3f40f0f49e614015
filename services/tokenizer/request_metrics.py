"""Per-request latency, token counts and the completion log line, measured where the client meets them.

TTFT, inter-token latency and end-to-end time are taken from this process's
monotonic clock only, at the moments responses are handed to the client
(DESIGN §3); no timestamp from another process is ever compared with them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from services.common.errors import KvgridError
from services.tokenizer.metrics import TokenizerMetrics

log = logging.getLogger("services.tokenizer.requests")


class RequestMetrics:
    """Use as ``with RequestMetrics(m, request_id) as r:`` around one request; the exit counts it by status
    and logs one completion line.

    The status is the finish reason ("stop", "length", "abort"), "cancelled" when the
    client went away, or the lower-cased gRPC code of the error that ended it.
    """

    def __init__(self, metrics: TokenizerMetrics, request_id: str = ""):
        self._metrics = metrics
        self._arrival = time.monotonic()
        self._first_output: float | None = None
        self._last_output: float | None = None
        self._finish_reason = ""
        self.request_id = request_id
        self.trace_id = ""
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0

    def __enter__(self) -> RequestMetrics:
        return self

    def begin(self, request_id: str, num_prompt_tokens: int, trace_id: str = "") -> None:
        """The request passed validation and goes to the scheduler under ``request_id``."""
        self.request_id = request_id
        self.trace_id = trace_id
        self.num_prompt_tokens = num_prompt_tokens
        self._metrics.prompt_tokens.inc(num_prompt_tokens)

    def output(self, num_tokens: int) -> None:
        """A response carrying ``num_tokens`` new tokens is about to be sent. Inter-token latency is per token: a
        response of several (deltas that piled up, or a completion's tokens held to its finish) counts each its
        share of the time since the previous response."""
        if num_tokens == 0:
            return
        now = time.monotonic()
        if self._last_output is None:
            self._first_output = now
            self._metrics.ttft.observe(now - self._arrival)
        else:
            share = (now - self._last_output) / num_tokens
            for _ in range(num_tokens):
                self._metrics.itl.observe(share)
        self._last_output = now
        self.num_output_tokens += num_tokens
        self._metrics.generation_tokens.inc(num_tokens)

    def finish(self, reason: str) -> None:
        self._finish_reason = reason

    def __exit__(self, exc_type, exc, tb) -> None:
        total = time.monotonic() - self._arrival
        if exc is None and self._finish_reason:
            self._metrics.e2e.observe(total)
            status = self._finish_reason
        elif isinstance(exc, KvgridError):
            status = exc.code.name.lower()
        elif isinstance(exc, grpc.aio.AioRpcError):
            status = exc.code().name.lower()
        elif exc_type in (asyncio.CancelledError, GeneratorExit) or exc is None:
            status = "cancelled"
        else:
            status = "internal"
        self._metrics.request_done(status)
        self._log_completion(status, total)

    def _log_completion(self, status: str, total: float) -> None:
        ttft = None if self._first_output is None else self._first_output - self._arrival
        fields = {
            "event": "request_done",
            "finish_reason": status,
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "ttft_s": None if ttft is None else round(ttft, 6),
            "e2e_s": round(total, 6),
        }
        extra = {"request_id": self.request_id or "-", "fields": fields}
        if self.trace_id:
            extra["trace_id"] = self.trace_id
        log.info(
            "request %s done: %s, prompt %d tokens, output %d tokens, ttft %s, total %.3fs",
            self.request_id or "-",
            status,
            self.num_prompt_tokens,
            self.num_output_tokens,
            "-" if ttft is None else f"{ttft:.3f}s",
            total,
            extra=extra,
        )
