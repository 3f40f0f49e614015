"""The scheduler's gRPC server, startable in-process (tests of other services use ``start``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.config import Config
from services.common.metrics import SchedulerMetrics
from services.common.server import Health, add_reflection, bind, new_server
from services.scheduler.engine import Engine
from services.scheduler.servicer import SchedulerServicer

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


@dataclass(slots=True)
class SchedulerServer:
    server: grpc.aio.Server
    port: int
    engine: Engine
    health: Health
    metrics: SchedulerMetrics

    async def stop(self, grace: float = 2.0) -> None:
        """Stop accepting, report NOT_SERVING, fail in-flight requests with UNAVAILABLE, then close."""
        self.health.set(False)
        await self.engine.stop()
        await self.server.stop(grace)


async def start(config: Config, serve_metrics: bool = False) -> SchedulerServer:
    """Bind ``config.network.host:scheduler_port`` (0 picks a free port), serve, and start dialing the worker."""
    server = new_server()
    health = Health(server, [SERVICE_NAME])
    metrics = SchedulerMetrics(config.model.name)
    engine = Engine(config, metrics, on_ready=health.set)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(SchedulerServicer(engine), server)
    add_reflection(server, [SERVICE_NAME])
    port = bind(server, config.network.host, config.network.scheduler_port)
    if serve_metrics:
        metrics.serve(config.network.scheduler_metrics_port, config.network.host)
    await server.start()
    engine.start()
    log.info("scheduler serving on %s:%d, worker at %s", config.network.host, port, config.network.worker_addr)
    return SchedulerServer(server, port, engine, health, metrics)
