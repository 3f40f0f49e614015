"""kvgrid.v1.Scheduler over gRPC: unpack, call the engine, pack."""

from __future__ import annotations

from opentelemetry.trace import Status, StatusCode

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc, worker_pb2
from services.common import tracing
from services.common.errors import Unavailable, grpc_errors
from services.scheduler.engine import Engine


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine):
        self._engine = engine

    @grpc_errors
    async def Submit(self, request: scheduler_pb2.SubmitRequest, context):
        span = tracing.tracer().start_span(
            "scheduler.submit",
            context=tracing.context_from_metadata(context),
            attributes={"kvgrid.request_id": request.request_id, "kvgrid.prompt_tokens": len(request.prompt_token_ids)},
        )
        stream = None
        try:
            stream = self._engine.submit(request, tracing.inject(span))
            async for response in stream.responses():
                yield response
        except Exception as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            raise
        finally:
            # Runs on normal end, on error, and when the caller cancels (the request is then aborted).
            if stream is not None:
                self._engine.release(stream)
                request = stream.request
                span.set_attribute("kvgrid.output_tokens", request.num_output_tokens)
                span.set_attribute("kvgrid.finish", request.status.value)
                span.set_attribute("kvgrid.num_preemptions", request.num_preemptions)
                span.set_attribute("kvgrid.num_cached_tokens", max(request.num_cached_tokens, 0))
            span.end()

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
