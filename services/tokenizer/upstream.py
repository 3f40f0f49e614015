"""The frontend's link to the scheduler: watch its health, fetch the worker's handshake, abort requests.

The scheduler's health is followed with the standard ``Health.Watch`` stream. Each
time it turns SERVING the handshake is fetched again (the worker may have been
restarted with other files); a broken stream means NOT_SERVING and a retry with
exponential backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.logs import request_log
from services.common.server import SERVING, peer_channel
from services.common.tls import TlsFiles
from services.tokenizer.model_state import ModelState

log = logging.getLogger(__name__)

INITIAL_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
INFO_TIMEOUT_S = 30.0
ABORT_TIMEOUT_S = 5.0
# The scheduler's step messages may run ahead of this frontend by one fixed HTTP/2 window only (no BDP
# growth to megabytes). A frontend that falls behind then holds up the scheduler's write, and the scheduler
# merges the following steps into one message with several tokens per request: deltas reach the clients
# late by a few steps at most, in fewer and larger messages, instead of a growing queue of one-token steps.
# 16 KB is about two step messages of one-token deltas for 256 requests: every message read ahead waits while
# the frontend works through the ones before it, so a busy frontend saw a new request's first token ~140 ms
# after the scheduler sent it with a 64 KB window, ~40 ms with this one (and the scheduler merges more steps).
LINK_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 16 * 1024)]


class SchedulerLink:
    """``tls``: mutual TLS toward the scheduler (None: plaintext); ``server_name``: the name its certificate must
    hold when ``addr`` is an IP address resolved from that name."""

    def __init__(self, addr: str, state: ModelState, tls: TlsFiles | None = None, server_name: str = ""):
        self.addr = addr
        self._state = state
        self.channel = peer_channel(addr, tls, LINK_OPTIONS, server_name)
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._watch_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def start(self) -> None:
        self._watch_task = asyncio.create_task(self._watch(), name="scheduler-watch")

    async def close(self) -> None:
        tasks = [t for t in (self._watch_task, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.channel.close()

    async def _watch(self) -> None:
        backoff = INITIAL_BACKOFF_S
        while True:
            try:
                async for reply in self._health.Watch(health_pb2.HealthCheckRequest(service="")):
                    serving = reply.status == SERVING
                    if serving:
                        info = await self.stub.GetWorkerInfo(
                            scheduler_pb2.GetWorkerInfoRequest(), timeout=INFO_TIMEOUT_S
                        )
                        await self._state.set_worker_info(info)
                        backoff = INITIAL_BACKOFF_S
                    else:
                        log.info(
                            "scheduler at %s reports %s",
                            self.addr,
                            health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status),
                        )
                    self._state.set_scheduler_serving(serving)
                log.warning("scheduler at %s ended the health stream", self.addr)
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                log.log(
                    logging.INFO if self._state.info is None else logging.WARNING,
                    "scheduler at %s: %s (%s); retrying in %.1fs",
                    self.addr,
                    e.code().name,
                    e.details(),
                    backoff,
                )
            except Exception:  # noqa: BLE001 - e.g. unusable tokenizer files: keep retrying, stay NOT_SERVING
                log.exception("cannot use the scheduler at %s; retrying in %.1fs", self.addr, backoff)
            self._state.set_scheduler_serving(False)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def abort_later(self, request_id: str) -> None:
        """Send Abort without waiting (also from a cancelled handler, whose own awaits would be cancelled)."""
        task = asyncio.get_running_loop().create_task(self.abort(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def abort(self, request_id: str) -> None:
        """Abort at the scheduler and wait for its answer; a failure is logged, not raised."""
        try:
            await self.stub.Abort(scheduler_pb2.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            request_log(log, request_id).warning("abort at the scheduler failed: %s %s", e.code().name, e.details())
