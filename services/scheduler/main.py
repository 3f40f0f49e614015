"""``kvgrid scheduler``: serve kvgrid.v1.Scheduler until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from services.common.config import Config
from services.common.logs import setup_logging
from services.common.tracing import setup_tracing, shutdown_tracing
from services.scheduler.service import start

log = logging.getLogger(__name__)


async def serve(config: Config) -> int:
    try:
        server = await start(config, serve_metrics=True)
    except OSError as e:  # a port in use
        log.error("cannot start the scheduler: %s", e)
        return 1
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
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
