"""``kvgrid scheduler``: serve kvgrid.v1.Scheduler until SIGTERM or SIGINT.

``start`` runs it in-process (tests of other services use it)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.config import Config
from services.common.logs import setup_logging
from services.common.server import Health, add_reflection, bind, new_server, shutdown_requested
from services.common.tls import describe_internal, internal_tls, server_credentials
from services.common.tracing import setup_tracing, shutdown_tracing
from services.scheduler.engine import Engine
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.servicer import SchedulerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name
DRAIN_POLL_S = 0.05


@dataclass(slots=True)
class SchedulerServer:
    server: grpc.aio.Server
    port: int
    engine: Engine
    health: Health
    metrics: SchedulerMetrics

    async def stop(self, grace: float = 2.0) -> None:
        """Report NOT_SERVING and refuse new requests, let live ones finish for up to ``grace`` seconds, fail
        what is left with UNAVAILABLE, then close."""
        self.engine.drain()
        deadline = time.monotonic() + grace
        while self.engine.num_live and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.engine.num_live:
            log.warning("%d requests still live after the %gs shutdown grace", self.engine.num_live, grace)
        await self.engine.stop()
        await self.server.stop(0.5)


async def start(config: Config, serve_metrics: bool = False) -> SchedulerServer:
    """Bind ``config.network.host:scheduler_port`` (0 picks a free port), serve, and start dialing the worker.
    Raises OSError (port taken) or ValueError (unreadable certificate files)."""
    credentials = server_credentials(internal_tls(config.security))
    server = new_server()
    health = Health(server, [SERVICE_NAME])
    metrics = SchedulerMetrics(config.model.name)
    engine = Engine(config, metrics, on_ready=health.set)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(engine), server)
    add_reflection(server, [SERVICE_NAME])
    port = bind(server, config.network.host, config.network.scheduler_port, credentials)
    net = config.network
    if serve_metrics:
        metrics.serve(net.scheduler_metrics_port, net.host)
        log.info("scheduler /metrics on %s:%d (plain HTTP, open)", net.host, net.scheduler_metrics_port)
    await server.start()
    engine.start()
    internal = describe_internal(config.security)
    log.info("scheduler serving on %s:%d (%s), worker at %s (%s)", net.host, port, internal, net.worker_addr, internal)
    return SchedulerServer(server, port, engine, health, metrics)


log = logging.getLogger(__name__)


async def serve(config: Config) -> int:
    try:
        server = await start(config, serve_metrics=True)
    except (OSError, ValueError) as e:  # a port in use, an unreadable certificate
        log.error("cannot start the scheduler: %s", e)
        return 1
    stopping = shutdown_requested()
    await stopping.wait()
    grace = config.lifecycle.shutdown_grace
    log.info("stopping: NOT_SERVING, refusing new requests, finishing live ones for up to %gs", grace)
    await server.stop(grace)
    return 0


def main(config: Config) -> int:
    setup_logging("scheduler", config.observability.log_level, config.observability.log_format)
    setup_tracing("kvgrid-scheduler")
    try:
        return asyncio.run(serve(config))
    finally:
        shutdown_tracing()
