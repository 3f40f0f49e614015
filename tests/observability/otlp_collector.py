"""A tiny OTLP/gRPC trace collector for tests: services export spans to it like to a real collector."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(slots=True, frozen=True)
class CollectedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    events: tuple = ()  # (name, attributes) in order


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(attributes) -> dict:
    return {a.key: _value(a.value) for a in attributes}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[CollectedSpan], lock: threading.Lock):
        self._sink, self._lock = sink, lock

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        collected = []
        for resource_spans in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = attrs.get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    collected.append(CollectedSpan(
                        service=service, name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        events=tuple((e.name, _attributes(e.attributes)) for e in span.events)))  # fmt: skip
        with self._lock:
            self._sink.extend(collected)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpCollector:
    """Listens on a free local port; ``endpoint`` goes into OTEL_EXPORTER_OTLP_ENDPOINT."""

    def __init__(self):
        self._spans: list[CollectedSpan] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self._spans, self._lock), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Variables that make a service export its spans here, quickly."""
        return {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
                "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100"}  # fmt: skip

    def spans(self) -> list[CollectedSpan]:
        with self._lock:
            return list(self._spans)

    def __enter__(self) -> OtlpCollector:
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)
