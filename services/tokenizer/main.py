"""``kvgrid tokenizer``: the public API frontend (kvgrid.v1.TextGeneration), until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal

from services.common.config import Config
from services.common.logs import setup_logging
from services.common.tracing import setup_tracing, shutdown_tracing
from services.tokenizer.server import start_tokenizer

log = logging.getLogger("services.tokenizer")


async def _serve(config: Config) -> int:
    net = config.network
    try:
        server = await start_tokenizer(config, port=net.tokenizer_port, http_port=net.http_port)
    except (OSError, ValueError) as e:
        log.error("cannot start the tokenizer frontend: %s", e)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    grace = config.lifecycle.shutdown_grace
    log.info("shutting down: NOT_SERVING, refusing new requests, finishing running streams for up to %gs", grace)
    await server.stop(grace)
    return 0


def main(config: Config) -> int:
    obs = config.observability
    setup_logging("tokenizer", obs.log_level, obs.log_format)
    setup_tracing("kvgrid-tokenizer")
    try:
        return asyncio.run(_serve(config))
    finally:
        shutdown_tracing()
