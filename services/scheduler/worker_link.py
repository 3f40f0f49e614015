"""Reaching the worker: dial with retry and backoff, handshake, and refuse a worker that does not match."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass

import grpc

from kvgrid.v1 import worker_pb2, worker_pb2_grpc
from services.common.config import Config
from services.common.server import peer_channel
from services.common.tls import internal_tls

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
HANDSHAKE_TIMEOUT_S = 30.0


@dataclass(slots=True)
class WorkerSession:
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    info: worker_pb2.HandshakeResponse


def incompatibilities(info: worker_pb2.HandshakeResponse, config: Config) -> list[str]:
    """Why this scheduler must not drive the worker that sent ``info`` (empty: it may)."""
    problems = []
    # The model name is only checked when the scheduler was told which model to expect.
    if (config.model.model or config.model.served_model_name) and info.model != config.model.name:
        problems.append(f"the worker serves model {info.model!r}, this scheduler expects {config.model.name!r}")
    if info.block_size != config.cache.block_size:
        problems.append(f"the worker's block size is {info.block_size}, this scheduler's is {config.cache.block_size}")
    if info.num_blocks < 1:
        problems.append("the worker has no KV blocks")
    return problems


def scheduler_id() -> str:
    return f"scheduler-{socket.gethostname()}-{os.getpid()}"


async def connect(config: Config) -> WorkerSession:
    """Dial and handshake until a compatible worker answers; never gives up. With --internal-tls-* the certificate
    files are read at each attempt, so a restarted worker is dialed with the files as they are now."""
    addr = config.network.worker_addr
    delay = FIRST_BACKOFF_S
    while True:
        try:
            tls = internal_tls(config.security)
        except ValueError as e:
            log.error("cannot dial the worker at %s: %s; retrying in %.1fs", addr, e, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF_S)
            continue
        channel = peer_channel(addr, tls)
        stub = worker_pb2_grpc.WorkerStub(channel)
        try:
            info = await stub.Handshake(
                worker_pb2.HandshakeRequest(scheduler_id=scheduler_id()), timeout=HANDSHAKE_TIMEOUT_S
            )
        except asyncio.CancelledError:
            await channel.close()
            raise
        except grpc.aio.AioRpcError as e:
            log.info("worker at %s not ready (%s: %s); retrying in %.1fs", addr, e.code().name, e.details(), delay)
        else:
            problems = incompatibilities(info, config)
            if not problems:
                return WorkerSession(channel, stub, info)
            log.error("refusing the worker at %s: %s; retrying in %.1fs", addr, "; ".join(problems), delay)
        await channel.close()
        await asyncio.sleep(delay)
        delay = min(delay * 2, MAX_BACKOFF_S)
