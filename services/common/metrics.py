"""What every service's Prometheus metrics share: bucket layouts, the registry, the /metrics port.

The series themselves (names fixed by DESIGN §3) live in each service's ``metrics`` module.

Each service builds its own ``*Metrics`` object with the model label bound, so a
process exports only its own series. prometheus-client metrics are thread- and
task-safe; handlers update them directly.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server

# LLM latencies span milliseconds (a decode step) to minutes (a long generation).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
)
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class ServiceMetrics:
    """One service's registry, with its model label bound; each service subclasses it with its own series."""

    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        self.model = model

    def _counter(self, name, doc, labels=()):
        return Counter(name, doc, ["model", *labels], registry=self.registry)

    def _gauge(self, name, doc, labels=()):
        return Gauge(name, doc, ["model", *labels], registry=self.registry)

    def _histogram(self, name, doc, buckets):
        return Histogram(name, doc, ["model"], buckets=buckets, registry=self.registry).labels(model=self.model)

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve /metrics on its own HTTP port (scheduler and worker)."""
        start_http_server(port, addr=host, registry=self.registry)


MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


def exposition_registry(registry: CollectorRegistry) -> CollectorRegistry:
    """What /metrics shows: ``registry``, or with ``PROMETHEUS_MULTIPROC_DIR`` set (prometheus-client's
    multiprocess mode: every process of a group writes its series to files there) the sums over every process
    that ever wrote there, so one scrape of a shared port gives the group's totals whichever process answers."""
    if not os.environ.get(MULTIPROC_DIR):
        return registry
    combined = CollectorRegistry()
    multiprocess.MultiProcessCollector(combined)
    return combined
