"""``kvgrid worker``: load the model, size and allocate the KV cache, serve kvgrid.v1.Worker."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from services.common import tracing
from services.common.config import Config
from services.common.logs import setup_logging
from services.common.metrics import WorkerMetrics

from .loader import ModelLoadError
from .memory import InsufficientMemory
from .server import start_worker

log = logging.getLogger(__name__)


def main(config: Config) -> int:
    setup_logging("worker", config.observability.log_level, config.observability.log_format)
    tracing.setup_tracing("kvgrid-worker")
    if config.device.num_threads > 0:
        import torch

        torch.set_num_threads(config.device.num_threads)
    try:
        return asyncio.run(_serve(config))
    except (ModelLoadError, InsufficientMemory) as exc:
        print(f"kvgrid worker: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a port in use
        print(f"kvgrid worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0


async def _serve(config: Config) -> int:
    metrics = WorkerMetrics(config.model.name)
    metrics.serve(config.network.worker_metrics_port, config.network.host)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    worker = await start_worker(config, config.network.worker_port, metrics)
    await stop.wait()
    grace = config.lifecycle.shutdown_grace
    log.info("stopping: NOT_SERVING, finishing the requests held for up to %gs", grace)
    await worker.stop(grace)
    tracing.shutdown_tracing()
    return 0
