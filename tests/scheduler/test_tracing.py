"""One span per request in the scheduler: child of the caller's span, parent of the worker's."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing
from tests.scheduler.harness import stack, submit_request


@pytest.mark.timeout(60)
def test_the_submit_span_links_the_caller_and_the_worker(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    test_tracer = provider.get_tracer("test")
    monkeypatch.setattr(tracing, "tracer", lambda: test_tracer)

    async def body():
        async with stack() as s:
            with test_tracer.start_as_current_span("caller") as caller:
                metadata = tracing.outgoing_metadata()
            async for _ in s.stub.Submit(submit_request("traced", [1, 2, 3], max_tokens=2), metadata=metadata):
                pass
            return caller, s.worker.worker.trace_contexts["traced"]

    caller, carrier = asyncio.run(asyncio.wait_for(body(), 50))
    (span,) = [span for span in exporter.get_finished_spans() if span.name == "scheduler.submit"]
    assert span.parent.span_id == caller.get_span_context().span_id
    assert span.context.trace_id == caller.get_span_context().trace_id
    assert span.attributes["kvgrid.request_id"] == "traced" and span.attributes["kvgrid.finish"] == "length"
    assert format(span.context.span_id, "016x") in carrier["traceparent"]
