"""A real gRPC kvgrid.v1.Scheduler that plays back scripted token deltas and records what it was asked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from kvgrid.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.common.server import Health, bind, new_server


@dataclass(slots=True)
class Script:
    """What Submit answers: one SubmitResponse per entry of ``deltas``, then ``finish`` (unless ``hang``)."""

    deltas: list[list[int]] = field(default_factory=list)
    finish: int = common_pb2.FINISH_REASON_LENGTH
    hang: bool = False  # keep the stream open after the deltas until the caller cancels
    error: grpc.StatusCode | None = None  # fail the call with this code instead
    num_cached_tokens: int = 0
    logprobs: bool = False
    delay_s: float = 0.0  # pause before each delta


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, info: worker_pb2.HandshakeResponse):
        self.info = info
        self.script = Script()
        self.scripts: dict[str, Script] = {}  # per request id, over ``script``
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.submit_metadata: list[dict[str, str]] = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []  # Submit calls the caller cancelled
        self.abort_delay_s = 0.0  # pause before an Abort takes effect (a busy scheduler)
        self.info_calls = 0

    async def Submit(self, request, context):
        self.submits.append(request)
        self.submit_metadata.append(dict(context.invocation_metadata() or ()))
        script = self.scripts.get(request.request_id, self.script)
        if script.error is not None:
            await context.abort(script.error, f"scripted {script.error.name}")
        n = len(request.prompt_token_ids)
        try:
            yield scheduler_pb2.SubmitResponse(num_prompt_tokens=n)  # admission, no tokens
            for i, ids in enumerate(script.deltas):
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                last = i == len(script.deltas) - 1 and not script.hang
                out = scheduler_pb2.SubmitResponse(
                    token_ids=ids, num_prompt_tokens=n, num_cached_tokens=script.num_cached_tokens
                )
                if script.logprobs:
                    for token_id in ids:
                        top = [common_pb2.TopLogprob(token_id=token_id, logprob=-0.5)]
                        top.append(common_pb2.TopLogprob(token_id=(token_id + 1) % self.info.vocab_size, logprob=-1.5))
                        out.logprobs.append(common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top=top))
                if last:
                    out.finish_reason = script.finish
                yield out
            if script.hang:
                await asyncio.Event().wait()
            elif not script.deltas:
                yield scheduler_pb2.SubmitResponse(num_prompt_tokens=n, finish_reason=script.finish)
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise

    async def Abort(self, request, context):
        if self.abort_delay_s:
            await asyncio.sleep(self.abort_delay_s)
        self.aborts.append(request.request_id)
        return scheduler_pb2.AbortResponse(found=True)

    async def GetStats(self, request, context):
        return scheduler_pb2.SchedulerStats(worker_ready=True)

    async def GetWorkerInfo(self, request, context):
        self.info_calls += 1
        return self.info


async def start_fake_scheduler(info: worker_pb2.HandshakeResponse, port: int = 0):
    """(server, fake, health, port); health starts SERVING."""
    server = new_server()
    fake = FakeScheduler(info)
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(fake, server)
    health = Health(server, ["kvgrid.v1.Scheduler"])
    bound = bind(server, "127.0.0.1", port)
    await server.start()
    health.set(True)
    return server, fake, health, bound
