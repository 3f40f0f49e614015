"""The frontend's one link to the scheduler: submit a tokenized request, iterate its deltas, abort it.

The gRPC servicer, the OpenAI routes and group routing all go through an
``EngineClient``; how it talks to the scheduler is its private business. Errors
surface as ``KvgridError`` subclasses carrying the scheduler's status code,
never as raw ``AioRpcError``.
"""

from __future__ import annotations

import grpc

from kvgrid.v1 import common_pb2, scheduler_pb2
from services.common.errors import KvgridError, error_for_code
from services.tokenizer.model_state import ModelState
from services.tokenizer.upstream import SchedulerLink


def scheduler_error(addr: str, e: grpc.aio.AioRpcError) -> KvgridError:
    return error_for_code(e.code(), f"scheduler at {addr}: {e.details() or e.code().name}")


class RequestHandle:
    """One submitted request: an async iterator of its scheduler deltas (``token_ids``, ``finish_reason``,
    ``logprobs``, ``num_prompt_tokens``, ``num_cached_tokens``); the last delta has ``finish_reason`` set."""

    def __init__(self, client: EngineClient, request_id: str, call):
        self.request_id = request_id
        self._client = client
        self._call = call
        self._stream = call.__aiter__()
        # True once the scheduler no longer holds the request (it finished it, failed it, or we aborted it).
        self.done_upstream = False

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> scheduler_pb2.SubmitResponse:
        try:
            delta = await self._stream.__anext__()
        except StopAsyncIteration:
            self.done_upstream = True
            raise
        except grpc.aio.AioRpcError as e:
            self.done_upstream = True
            raise scheduler_error(self._client.addr, e) from e
        if delta.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.done_upstream = True
        return delta

    async def stop(self) -> None:
        """End the request upstream and wait until the scheduler holds nothing under its id (so the id may be
        reused at once)."""
        if self.done_upstream:
            return
        self.done_upstream = True
        self._call.cancel()
        await self._client.link.abort(self.request_id)

    def close(self) -> None:
        """End the request upstream without waiting; synchronous, so it works from a cancelled task."""
        if self.done_upstream:
            return
        self.done_upstream = True
        self._call.cancel()
        self._client.abort(self.request_id)


class EngineClient:
    """Owns the connection to the scheduler at ``addr`` and keeps ``state`` in step with its health."""

    def __init__(self, addr: str, state: ModelState):
        self.addr = addr
        self.link = SchedulerLink(addr, state)

    def start(self) -> None:
        self.link.start()

    async def close(self) -> None:
        await self.link.close()

    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        trace_context: dict[str, str],
    ) -> RequestHandle:
        """Start ``request_id``; ``sampling`` is the scheduler-facing form (``validation.submit_sampling``)."""
        submit = scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=prompt_ids, sampling=sampling)
        call = self.link.stub.Submit(submit, metadata=list(trace_context.items()))
        return RequestHandle(self, request_id, call)

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` at the scheduler, fire-and-forget; safe from a cancelled task."""
        self.link.abort_later(request_id)
