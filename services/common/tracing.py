"""OpenTelemetry tracing: one trace per request across tokenizer → scheduler → worker.

The exporter is chosen by the standard variables: ``OTEL_TRACES_EXPORTER``
(``otlp``, ``console`` or ``none``) and ``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``. With none of them set, tracing stays
off: spans are non-recording no-ops and cost next to nothing on the hot path.

Context crosses processes as W3C ``traceparent`` headers: in gRPC metadata for
calls (``outgoing_metadata`` / ``context_from_metadata``) and in the
``NewRequest.trace_context`` map from the scheduler to the worker
(``inject`` / ``extract``).
"""

from __future__ import annotations

import atexit
import logging
import os

from opentelemetry import propagate, trace
from opentelemetry.context import Context

log = logging.getLogger(__name__)
_provider = None


def _exporter_name() -> str:
    name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if name:
        return name
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return "none"


def setup_tracing(service_name: str) -> bool:
    """Install a tracer provider for this process; returns whether spans are exported."""
    global _provider
    name = _exporter_name()
    if name == "none" or _provider is not None:
        return _provider is not None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if name == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers and TLS from OTEL_EXPORTER_OTLP_* variables
    elif name == "console":
        exporter = ConsoleSpanExporter()
    else:
        log.warning("OTEL_TRACES_EXPORTER=%s is not supported (use otlp, console or none); tracing off", name)
        return False
    service = os.environ.get("OTEL_SERVICE_NAME") or service_name
    _provider = TracerProvider(resource=Resource.create({"service.name": service}))
    _provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(_provider)
    atexit.register(shutdown_tracing)
    log.info("tracing to %s as service %s", name, service)
    return True


def shutdown_tracing() -> None:
    """Flush and stop the exporter (call on graceful shutdown; safe to call twice)."""
    global _provider
    if _provider is not None:
        provider, _provider = _provider, None
        provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer("kvgrid")


def context_from_metadata(servicer_context) -> Context:
    """The caller's trace context from an incoming call's metadata."""
    metadata = servicer_context.invocation_metadata() or ()
    return propagate.extract({key: value for key, value in metadata if isinstance(value, str)})


def outgoing_metadata() -> list[tuple[str, str]]:
    """Metadata carrying the current span's context, for an outgoing gRPC call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def inject(span: trace.Span | None = None) -> dict[str, str]:
    """A carrier dict for ``span`` (or the current span), e.g. for ``NewRequest.trace_context``."""
    carrier: dict[str, str] = {}
    ctx = trace.set_span_in_context(span) if span is not None else None
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(carrier) -> Context:
    """The context a carrier dict (or protobuf map) holds."""
    return propagate.extract(dict(carrier))


def trace_id_hex(span: trace.Span | None = None) -> str:
    """The trace id of ``span`` (or the current span) as 32 hex digits, '' when none."""
    ctx = (span or trace.get_current_span()).get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
