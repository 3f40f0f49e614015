"""Helpers for scheduler service tests: a fake worker + an in-process scheduler + a client stub."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.config import (
    CacheConfig,
    Config,
    ModelConfig,
    NetworkConfig,
    ObservabilityConfig,
    SchedulerConfig,
)
from services.common.server import insecure_channel
from services.scheduler.server import SchedulerServer, start
from tests.scheduler.fake_worker import FakeWorkerServer, start_fake_worker


def make_config(worker_addr: str, block_size: int, model: ModelConfig | None = None, **scheduler) -> Config:
    return Config(
        model=model or ModelConfig(),
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(**scheduler),
        observability=ObservabilityConfig(),
        network=NetworkConfig(host="127.0.0.1", scheduler_port=0, worker_addr=worker_addr),
    )


@dataclass(slots=True)
class Stack:
    worker: FakeWorkerServer
    scheduler: SchedulerServer
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub

    async def stats(self) -> scheduler_pb2.SchedulerStats:
        return await self.stub.GetStats(scheduler_pb2.GetStatsRequest())

    async def health(self) -> int:
        reply = await health_pb2_grpc.HealthStub(self.channel).Check(
            health_pb2.HealthCheckRequest(service="kvgrid.v1.Scheduler")
        )
        return reply.status

    async def wait_for(self, predicate, timeout: float = 10.0) -> scheduler_pb2.SchedulerStats:
        """Poll GetStats until ``predicate(stats)`` holds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            stats = await self.stats()
            if predicate(stats):
                return stats
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"condition not met in {timeout}s; last stats: {stats}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def stack(worker_kw: dict | None = None, model: ModelConfig | None = None, **scheduler):
    worker = await start_fake_worker(**(worker_kw or {}))
    config = make_config(worker.addr, worker.worker.config.block_size, model, **scheduler)
    server = await start(config)
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    s = Stack(worker, server, channel, scheduler_pb2_grpc.SchedulerStub(channel))
    try:
        await s.wait_for(lambda st: st.worker_ready)
        yield s
    finally:
        await channel.close()
        await server.stop(grace=0.5)
        await s.worker.stop()  # a test may have replaced the worker


def submit_request(request_id: str, prompt: list[int], **sampling) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=common_pb2.SamplingParams(**sampling)
    )


async def collect(stub, request: scheduler_pb2.SubmitRequest) -> tuple[list[int], int, list]:
    """(token ids, finish reason, all responses) of one Submit."""
    tokens, responses = [], []
    async for response in stub.Submit(request):
        responses.append(response)
        tokens.extend(response.token_ids)
    return tokens, responses[-1].finish_reason, responses
