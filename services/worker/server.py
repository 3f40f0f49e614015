"""``kvgrid worker``: load the model, size and allocate the KV cache, serve kvgrid.v1.Worker until SIGTERM.

``start_worker`` starts the gRPC server in-process (``main``, and other suites tests)."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from kvgrid.v1 import worker_pb2, worker_pb2_grpc
from services.common import tracing
from services.common.config import Config
from services.common.logs import setup_logging
from services.common.server import Health, add_reflection, bind, new_server, shutdown_requested
from services.common.tls import describe_internal, internal_tls, server_credentials
from services.worker.core import WorkerCore, build_core
from services.worker.metrics import WorkerMetrics
from services.worker.parallel.ranks import exit_now
from services.worker.servicer import WorkerServicer
from services.worker.setup.loader import ModelLoadError
from services.worker.setup.memory import InsufficientMemory
from services.worker.setup.threads import set_math_threads

log = logging.getLogger(__name__)

SERVICE_NAME = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name
DRAIN_POLL_S = 0.05


@dataclass(slots=True)
class RunningWorker:
    server: grpc.aio.Server
    port: int
    servicer: WorkerServicer
    health: Health
    core: WorkerCore

    async def stop(self, grace: float | None = 5.0) -> None:
        """Report NOT_SERVING and refuse new handshakes; keep running the steps of the requests it holds until
        they finish (the scheduler drops them) or ``grace`` seconds pass; then close."""
        self.health.set(False)
        self.servicer.draining = True
        grace = grace or 0.0
        deadline = time.monotonic() + grace
        while self.servicer.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.servicer.num_requests:
            log.warning("%d requests still held after the %gs shutdown grace", self.servicer.num_requests, grace)
        await self.server.stop(0.5)
        if self.core.ranks is not None:  # after the last step: the model thread sends the ranks their stop
            await asyncio.get_running_loop().run_in_executor(self.servicer.model_thread, self.core.ranks.stop)
        self.servicer.shutdown()


async def start_worker(
    config: Config, port: int = 0, metrics: WorkerMetrics | None = None, core: WorkerCore | None = None
) -> RunningWorker:
    """Serve on ``config.network.host:port`` (0: a free port). Health is NOT_SERVING while the model
    loads and SERVING once the KV cache is allocated. Pass ``core`` to reuse a loaded worker.
    Raises ModelLoadError / InsufficientMemory after stopping the server."""
    credentials = server_credentials(internal_tls(config.security))
    server = new_server()
    servicer = WorkerServicer(metrics)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health = Health(server, [SERVICE_NAME])
    add_reflection(server, [SERVICE_NAME])
    bound = bind(server, config.network.host, port, credentials)
    await server.start()
    log.info("worker gRPC on %s:%d (%s; loading)", config.network.host, bound, describe_internal(config.security))
    try:
        if core is None:
            loop = asyncio.get_running_loop()
            core = await loop.run_in_executor(servicer.model_thread, build_core, config, metrics)
    except BaseException:
        await server.stop(None)
        servicer.shutdown()
        raise
    servicer.attach(core)
    if core.ranks is not None:
        core.ranks.on_lost = _go_down(asyncio.get_running_loop(), server, health)
    health.set(True)
    log.info("worker ready: %d KV blocks", core.handshake.num_blocks)
    return RunningWorker(server, bound, servicer, health, core)


def _go_down(loop: asyncio.AbstractEventLoop, server: grpc.aio.Server, health: Health) -> Callable[[str], None]:
    """What rank 0 does when another tensor-parallel rank dies: NOT_SERVING, end every stream (the
    scheduler sees UNAVAILABLE and re-dials), close the port, and end the process with status 1."""

    async def down(reason: str) -> None:
        health.set(False)
        await server.stop(0)
        exit_now(reason)

    def on_lost(reason: str) -> None:  # called on the ranks' watch thread
        asyncio.run_coroutine_threadsafe(down(reason), loop)

    return on_lost


log = logging.getLogger(__name__)


def main(config: Config) -> int:
    setup_logging("worker", config.observability.log_level, config.observability.log_format)
    tracing.setup_tracing("kvgrid-worker")
    set_math_threads(config.device.num_threads)
    try:
        return asyncio.run(_serve(config))
    except (ModelLoadError, InsufficientMemory) as exc:
        print(f"kvgrid worker: {exc}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # a port in use, an unreadable certificate
        print(f"kvgrid worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


async def _serve(config: Config) -> int:
    metrics = WorkerMetrics(config.model.name)
    metrics.serve(config.network.worker_metrics_port, config.network.host)
    log.info("worker /metrics on %s:%d (plain HTTP, open)", config.network.host, config.network.worker_metrics_port)
    stop = shutdown_requested()
    worker = await start_worker(config, config.network.worker_port, metrics)
    await stop.wait()
    grace = config.lifecycle.shutdown_grace
    log.info("stopping: NOT_SERVING, finishing the requests held for up to %gs", grace)
    await worker.stop(grace)
    tracing.shutdown_tracing()
    return 0
