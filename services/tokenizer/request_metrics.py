"""Per-request latency and token counts, measured where the client meets them (DESIGN §3)."""

from __future__ import annotations

import asyncio
import time

import grpc

from services.common.errors import KvgridError
from services.common.metrics import TokenizerMetrics


class RequestMetrics:
    """Use as ``with RequestMetrics(m) as r:`` around one request; the exit counts it by status.

    The status is the finish reason ("stop", "length", "abort"), "cancelled" when the
    client went away, or the lower-cased gRPC code of the error that ended it.
    """

    def __init__(self, metrics: TokenizerMetrics):
        self._metrics = metrics
        self._arrival = time.monotonic()
        self._last_output: float | None = None
        self._finish_reason = ""

    def __enter__(self) -> RequestMetrics:
        return self

    def prompt(self, num_tokens: int) -> None:
        self._metrics.prompt_tokens.inc(num_tokens)

    def output(self, num_tokens: int) -> None:
        """A response carrying ``num_tokens`` new tokens is about to be sent."""
        if num_tokens == 0:
            return
        now = time.monotonic()
        if self._last_output is None:
            self._metrics.ttft.observe(now - self._arrival)
        else:
            self._metrics.itl.observe(now - self._last_output)
        self._last_output = now
        self._metrics.generation_tokens.inc(num_tokens)

    def finish(self, reason: str) -> None:
        self._finish_reason = reason

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None and self._finish_reason:
            self._metrics.e2e.observe(time.monotonic() - self._arrival)
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
