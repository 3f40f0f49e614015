"""The per-Submit stream: what the step loop hands a request's caller, turned into SubmitResponses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvgrid.v1 import common_pb2, scheduler_pb2
from services.scheduler.convert import add_output
from services.scheduler.request import Request
from services.scheduler.step_plan import RequestOutput

_ABORTED = object()


class RequestStream:
    """Outputs of one request in arrival order; ends with a finish reason or an error."""

    __slots__ = ("request", "_queue", "done")

    def __init__(self, request: Request):
        self.request = request
        self._queue: asyncio.Queue = asyncio.Queue()
        # Set once the request left the scheduler (finished, aborted or failed): nothing to abort.
        self.done = False

    def push(self, output: RequestOutput) -> None:
        if output.finish is not None:
            self.done = True
        self._queue.put_nowait(output)

    def abort(self) -> None:
        self.done = True
        self._queue.put_nowait(_ABORTED)

    def fail(self, error: Exception) -> None:
        self.done = True
        self._queue.put_nowait(error)

    async def responses(self) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        """The admission message, then one message per batch of outputs waiting when the caller reads."""
        request = self.request
        yield scheduler_pb2.SubmitResponse(num_prompt_tokens=request.num_prompt_tokens)
        queue = self._queue
        while True:
            item = await queue.get()
            response = scheduler_pb2.SubmitResponse(num_prompt_tokens=request.num_prompt_tokens)
            while True:
                if isinstance(item, Exception):
                    raise item
                if item is _ABORTED:
                    response.finish_reason = common_pb2.FINISH_REASON_ABORT
                    break
                add_output(response, item)
                if item.finish is not None:
                    break
                if queue.empty():
                    break
                item = queue.get_nowait()
            if request.num_cached_tokens >= 0:
                response.num_cached_tokens = request.num_cached_tokens
            yield response
            if response.finish_reason:
                return
