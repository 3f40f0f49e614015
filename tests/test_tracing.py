"""Trace context survives the two hops kvgrid uses: gRPC metadata and the NewRequest carrier map."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.common import tracing


class FakeServicerContext:
    def __init__(self, metadata):
        self._metadata = metadata

    def invocation_metadata(self):
        return self._metadata


def test_context_crosses_metadata_and_carrier_map():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    t = provider.get_tracer("test")
    with t.start_as_current_span("tokenizer") as root:
        metadata = tracing.outgoing_metadata()
    incoming = tracing.context_from_metadata(FakeServicerContext(metadata))
    with t.start_as_current_span("scheduler", context=incoming) as s:
        carrier = tracing.inject(s)
    with t.start_as_current_span("worker", context=tracing.extract(carrier)):
        pass
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert {span.context.trace_id for span in spans.values()} == {root.get_span_context().trace_id}
    assert spans["scheduler"].parent.span_id == spans["tokenizer"].context.span_id
    assert spans["worker"].parent.span_id == spans["scheduler"].context.span_id


def test_without_otel_variables_nothing_is_exported():
    code = (
        "from services.common import tracing; import sys;"
        "sys.exit(0 if tracing.setup_tracing('t') is False and tracing.outgoing_metadata() == [] else 1)"
    )
    env = {"PATH": "", "PYTHONPATH": "."}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0


def test_console_exporter_is_selected_by_the_standard_variable():
    code = "from services.common import tracing; import sys; sys.exit(0 if tracing.setup_tracing('t') else 1)"
    env = {"PATH": "", "PYTHONPATH": ".", "OTEL_TRACES_EXPORTER": "console"}
    assert subprocess.run([sys.executable, "-c", code], env=env, timeout=60).returncode == 0
    assert trace.get_tracer_provider() is not None
