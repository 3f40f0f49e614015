"""kvgrid.v1.Scheduler over gRPC: unpack, call the engine, pack."""

from __future__ import annotations

import asyncio

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.common import tracing
from services.common.errors import InvalidArgument, KvgridError, Unavailable, grpc_errors
from services.common.request_checks import check_request_id
from services.scheduler.engine import Engine
from services.scheduler.frontends import FrontendStream, end_request_span, start_request_span


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine):
        self._engine = engine

    @grpc_errors
    async def Submit(self, request: scheduler_pb2.SubmitRequest, context):
        # A tool's request: the frontend's rules for its id too (ids on Connect are the frontend's own).
        check_request_id(request.request_id)
        span = start_request_span(
            request.request_id, len(request.prompt_token_ids), tracing.context_from_metadata(context)
        )
        stream = None
        error = None
        try:
            stream = self._engine.submit(request, tracing.inject(span))
            async for response in stream.responses():
                yield response
        except Exception as e:
            error = e
            raise
        finally:
            # Runs on normal end, on error, and when the caller cancels (the request is then aborted).
            if stream is not None:
                self._engine.release(stream)
            end_request_span(span, stream.request if stream is not None else None, error)

    @grpc_errors
    async def Connect(self, request_iterator, context):
        """Requests and aborts in; one message of deltas per step out. A broken stream aborts its requests."""
        frontend = self._engine.connect(context.peer())
        reader = asyncio.create_task(self._read_frontend(request_iterator, frontend), name="frontend-reader")
        reader.add_done_callback(lambda _: frontend.close())
        try:
            await context.send_initial_metadata(())  # tells the frontend the stream is registered
            async for message in frontend.messages():
                yield message
            if not reader.cancelled() and reader.exception() is not None:
                raise reader.exception()
        finally:
            reader.cancel()
            self._engine.disconnect(frontend)

    async def _read_frontend(self, request_iterator, frontend: FrontendStream) -> None:
        async for message in request_iterator:
            for submit in message.submits:
                self._admit(submit, frontend)
            for request_id in message.aborts:
                if request_id in frontend.requests:
                    self._engine.abort(request_id)

    def _admit(self, submit: scheduler_pb2.SubmitRequest, frontend: FrontendStream) -> None:
        if not submit.request_id:
            frontend.fail("", InvalidArgument("request_id", "must be set on Connect (deltas are routed by it)"))
            return
        parent = tracing.extract(submit.trace_context)
        span = start_request_span(submit.request_id, len(submit.prompt_token_ids), parent)
        try:
            self._engine.submit(
                submit, tracing.inject(span), lambda request: frontend.add(request, span, submit.deliver_at_finish)
            )
        except KvgridError as e:
            frontend.fail(submit.request_id, e)
            end_request_span(span, None, e)

    @grpc_errors
    async def Abort(self, request: scheduler_pb2.AbortRequest, context) -> scheduler_pb2.AbortResponse:
        return scheduler_pb2.AbortResponse(found=self._engine.abort(request.request_id))

    @grpc_errors
    async def GetStats(self, request: scheduler_pb2.GetStatsRequest, context) -> scheduler_pb2.SchedulerStats:
        return self._engine.stats()

    @grpc_errors
    async def GetWorkerInfo(self, request, context) -> worker_pb2.HandshakeResponse:
        info = self._engine.worker_info
        if info is None:
            raise Unavailable("no worker has completed the handshake yet")
        return info
