"""What an operator's tools see of a running service: gRPC health, HTTP /health, Prometheus /metrics."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families


def grpc_health(addr: str, service: str = "", timeout: float = 3.0) -> str | None:
    """The status name ('SERVING', 'NOT_SERVING', ...) of a Health.Check, None when nothing answers."""
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return None
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str] | None:
    """(status code, body) of GET http://127.0.0.1:port/path; None when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


class Samples:
    """One scrape of a /metrics page: sample values by name and labels."""

    def __init__(self, text: str):
        self.rows = [
            (sample.name, sample.labels, sample.value)
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        ]

    def names(self) -> set[str]:
        return {name for name, _, _ in self.rows}

    def get(self, name: str, **labels: str) -> float:
        """Sum of the samples called ``name`` whose labels include ``labels``; 0 when there are none
        (a labelled counter has no series before its first increment)."""
        return sum(
            value
            for row_name, row_labels, value in self.rows
            if row_name == name and all(row_labels.get(k) == v for k, v in labels.items())
        )

    def label_values(self, label: str, prefix: str = "kvgrid_") -> set[str]:
        return {labels.get(label, "") for name, labels, _ in self.rows if name.startswith(prefix)}


def scrape(port: int) -> Samples:
    reply = http_get(port, "/metrics")
    assert reply is not None and reply[0] == 200, f"/metrics on port {port}: {reply}"
    return Samples(reply[1])


def wait_for(predicate: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """Poll until ``predicate()`` is truthy and return it; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {value!r})")
        time.sleep(interval)
