"""A real gRPC kvgrid.v1.Scheduler that plays back scripted token deltas and records what it was asked."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from kvgrid.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.common.server import Health, bind, new_server


@dataclass(slots=True)
class Script:
    """What a submit gets: one RequestDelta per entry of ``deltas``, then ``finish`` (unless ``hang``)."""

    deltas: list[list[int]] = field(default_factory=list)
    finish: int = common_pb2.FINISH_REASON_LENGTH
    hang: bool = False  # keep the stream open after the deltas until the caller cancels
    error: grpc.StatusCode | None = None  # fail the request with this code instead
    num_cached_tokens: int = 0
    logprobs: bool = False
    delay_s: float = 0.0  # pause before each delta


class FakeScheduler(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, info: worker_pb2.HandshakeResponse):
        self.info = info
        self.script = Script()
        self.scripts: dict[str, Script] = {}  # per request id, over ``script``
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.aborts: list[str] = []
        self.cancelled: list[str] = []  # requests whose playback an abort or a broken stream stopped
        self.events: list[tuple[str, str]] = []  # ("submit" | "abort", request_id) in the order handled
        self.abort_delay_s = 0.0  # pause before an abort takes effect (a busy scheduler)
        self.info_calls = 0
        self.num_connects = 0
        self.streams: list[asyncio.Task] = []  # the reader task of each Connect stream, newest last

    async def Connect(self, request_iterator, context):
        self.num_connects += 1
        out: asyncio.Queue = asyncio.Queue()
        playing: dict[str, asyncio.Task] = {}

        async def read() -> None:
            async for message in request_iterator:
                for submit in message.submits:
                    self._submit(submit, playing, out)
                for request_id in message.aborts:
                    if self.abort_delay_s:
                        await asyncio.sleep(self.abort_delay_s)
                    self.aborts.append(request_id)
                    self.events.append(("abort", request_id))
                    task = playing.pop(request_id, None)
                    if task is not None:
                        task.cancel()

        reader = asyncio.create_task(read())
        self.streams.append(reader)
        await context.send_initial_metadata(())
        try:
            while True:
                yield await out.get()
        finally:
            reader.cancel()
            for task in playing.values():
                task.cancel()

    def _submit(self, submit, playing: dict, out: asyncio.Queue) -> None:
        request_id = submit.request_id
        self.submits.append(submit)
        self.events.append(("submit", request_id))
        script = self.scripts.get(request_id, self.script)
        code = script.error
        if request_id in playing:
            code = grpc.StatusCode.ALREADY_EXISTS
        if code is not None:
            delta = scheduler_pb2.RequestDelta(request_id=request_id, error_code=code.value[0])
            delta.error_message = f"scripted {code.name}"
            out.put_nowait(scheduler_pb2.SchedulerMessage(deltas=[delta]))
            return
        playing[request_id] = asyncio.create_task(self._play(submit, script, playing, out))

    async def _play(self, submit, script: Script, playing: dict, out: asyncio.Queue) -> None:
        request_id, n = submit.request_id, len(submit.prompt_token_ids)
        try:
            for i, ids in enumerate(script.deltas):
                if script.delay_s:
                    await asyncio.sleep(script.delay_s)
                delta = scheduler_pb2.RequestDelta(
                    request_id=request_id,
                    token_ids=ids,
                    num_prompt_tokens=n,
                    num_cached_tokens=script.num_cached_tokens,
                )
                if script.logprobs:
                    for token_id in ids:
                        top = [common_pb2.TopLogprob(token_id=token_id, logprob=-0.5)]
                        top.append(common_pb2.TopLogprob(token_id=(token_id + 1) % self.info.vocab_size, logprob=-1.5))
                        delta.logprobs.append(common_pb2.TokenLogprob(token_id=token_id, logprob=-0.5, top=top))
                if i == len(script.deltas) - 1 and not script.hang:
                    delta.finish_reason = script.finish
                out.put_nowait(scheduler_pb2.SchedulerMessage(deltas=[delta]))
                await asyncio.sleep(0)  # one message per step: let the stream write it
            if script.hang:
                await asyncio.Event().wait()
            elif not script.deltas:
                delta = scheduler_pb2.RequestDelta(
                    request_id=request_id, num_prompt_tokens=n, finish_reason=script.finish
                )
                out.put_nowait(scheduler_pb2.SchedulerMessage(deltas=[delta]))
            playing.pop(request_id, None)
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
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
