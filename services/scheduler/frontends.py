"""One connected frontend (a ``Scheduler.Connect`` stream): its requests and the message of deltas built for it.

The step loop pushes each sampled token into the owning request's ``FrontendRequest``,
which appends it to the frontend's pending ``SchedulerMessage`` (one ``RequestDelta``
per request, created on its first token of the step). After the step the engine
calls ``flush``: the whole message goes out as one write. If the writer is still
busy with the previous one, the next steps keep appending to the same message,
so a slow frontend gets fewer, larger messages and never a growing queue.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable

from opentelemetry.trace import Status, StatusCode

from kvgrid.v1 import common_pb2, scheduler_pb2
from services.common import tracing
from services.common.errors import KvgridError
from services.scheduler.convert import FINISH_REASONS
from services.scheduler.kv_events import fill_kv_events
from services.scheduler.request import Request
from services.scheduler.step_plan import RequestOutput

log = logging.getLogger(__name__)

# Block hashes in one message's KvEvents (about 10 bytes each on the wire).
MAX_KV_EVENTS = 65536


def start_request_span(request_id: str, num_prompt_tokens: int, parent) -> tracing.trace.Span:
    return tracing.tracer().start_span(
        "scheduler.submit",
        context=parent,
        attributes={"kvgrid.request_id": request_id, "kvgrid.prompt_tokens": num_prompt_tokens},
    )


def end_request_span(span, request: Request | None, error: BaseException | None = None) -> None:
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, str(error)))
    if request is not None:
        span.set_attribute("kvgrid.output_tokens", request.num_output_tokens)
        span.set_attribute("kvgrid.finish", request.status.value)
        span.set_attribute("kvgrid.num_preemptions", request.num_preemptions)
        span.set_attribute("kvgrid.num_cached_tokens", max(request.num_cached_tokens, 0))
    span.end()


class FrontendRequest:
    """The step loop's handle on one request of a frontend stream (the Connect counterpart of RequestStream).

    ``at_finish`` (``SubmitRequest.deliver_at_finish``): after the first token, tokens and logprobs are held here
    and go out with the finish, so that a completion answered once costs the frontend one delta, not one a step."""

    __slots__ = ("request", "frontend", "span", "done", "at_finish", "held")

    def __init__(self, request: Request, frontend: FrontendStream, span, at_finish: bool = False):
        self.request = request
        self.frontend = frontend
        self.span = span
        self.done = False
        self.at_finish = at_finish
        # The outputs held since the first token went out (at_finish); None while each goes out in its step.
        self.held: list[RequestOutput] | None = None

    def push(self, output: RequestOutput) -> None:
        held = self.held
        if held is not None and output.finish is None:
            held.append(output)
            return
        delta = self.frontend.delta(self.request)
        if held:
            self._release(delta)
        elif self.at_finish:
            self.held = []  # this is the first token: the rest wait for the finish
        if output.pooled is not None:
            delta.embedding.extend(output.pooled)
        else:
            delta.token_ids.append(output.token_id)
        if output.logprob is not None:
            delta.logprobs.append(output.logprob)
        if output.prompt_logprobs is not None:
            delta.prompt_logprobs.extend(output.prompt_logprobs)
        if output.finish is not None:
            delta.finish_reason = FINISH_REASONS[output.finish]
            self._end()

    def abort(self) -> None:
        delta = self.frontend.delta(self.request)
        if self.held:
            self._release(delta)
        delta.finish_reason = common_pb2.FINISH_REASON_ABORT
        self._end()
        self.frontend.flush()

    def fail(self, error: KvgridError) -> None:
        self.frontend.fail(self.request.request_id, error)
        self._end(error)

    def _release(self, delta: scheduler_pb2.RequestDelta) -> None:
        """The held outputs into ``delta``, in order (before the output that releases them)."""
        held, self.held = self.held, []
        delta.token_ids.extend([output.token_id for output in held])
        logprobs = [output.logprob for output in held if output.logprob is not None]
        if logprobs:
            delta.logprobs.extend(logprobs)

    def _end(self, error: BaseException | None = None) -> None:
        self.done = True
        self.frontend.requests.pop(self.request.request_id, None)
        end_request_span(self.span, self.request, error)


class FrontendStream:
    """The requests one Connect stream submitted, and the next message of deltas for it."""

    def __init__(self, peer: str, abort: Callable[[str], bool]):
        self.peer = peer
        self._abort = abort
        self.requests: dict[str, FrontendRequest] = {}
        self._message = scheduler_pb2.SchedulerMessage()
        self._deltas: dict[str, scheduler_pb2.RequestDelta] = {}
        self._ready = asyncio.Event()
        self.closed = False
        # Routing news not sent yet: the latest load, and prefix-cache changes netted per hash.
        self._load: scheduler_pb2.GroupLoad | None = None
        self._kv_cleared = False
        self._kv_changes: dict[int, bool] = {}
        self._block_size = 0

    def add(self, request: Request, span, at_finish: bool = False) -> FrontendRequest:
        entry = self.requests[request.request_id] = FrontendRequest(request, self, span, at_finish)
        return entry

    def delta(self, request: Request) -> scheduler_pb2.RequestDelta:
        """The request's entry in the pending message, added on first use."""
        delta = self._deltas.get(request.request_id)
        if delta is None:
            delta = self._message.deltas.add()
            delta.request_id = request.request_id
            delta.num_prompt_tokens = request.num_prompt_tokens
            self._deltas[request.request_id] = delta
        if request.num_cached_tokens > 0:
            delta.num_cached_tokens = request.num_cached_tokens
        return delta

    def fail(self, request_id: str, error: KvgridError) -> None:
        """The request's last delta: the error's status code and message."""
        delta = self._deltas.get(request_id)
        if delta is None:
            delta = self._message.deltas.add(request_id=request_id)
            self._deltas[request_id] = delta
        delta.error_code = error.code.value[0]
        delta.error_message = str(error)
        self.flush()

    def publish(
        self, load: scheduler_pb2.GroupLoad | None, cleared: bool, changes: dict[int, bool], block_size: int
    ) -> None:
        """Queue the scheduler's load and prefix-cache changes for the next message, and wake the writer."""
        if load is not None:
            self._load = load
        if cleared:
            self._kv_cleared = True
            self._kv_changes = {}
        self._kv_changes.update(changes)
        self._block_size = block_size
        if load is not None or cleared or changes:
            self._ready.set()

    def flush(self) -> None:
        """Hand the pending message to the writer (if it holds anything)."""
        if self._deltas:
            self._ready.set()

    async def messages(self) -> AsyncIterator[scheduler_pb2.SchedulerMessage]:
        """Pending messages as the stream can take them; returns once ``close`` was called."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self.closed:
                return
            message, self._message = self._message, scheduler_pb2.SchedulerMessage()
            self._deltas = {}
            if self._load is not None:
                message.load.CopyFrom(self._load)
                self._load = None
            if self._kv_cleared or self._kv_changes:
                fill_kv_events(message.kv_events, self._kv_cleared, self._take_kv_changes(), self._block_size)
                self._kv_cleared = False
            yield message

    def _take_kv_changes(self) -> dict[int, bool]:
        """At most MAX_KV_EVENTS of the pending changes (a big cache's snapshot goes out over several messages,
        each well under gRPC's message size limit)."""
        changes = self._kv_changes
        if len(changes) <= MAX_KV_EVENTS:
            self._kv_changes = {}
            return changes
        self._ready.set()  # the rest goes in the next message
        return {value: changes.pop(value) for value in list(itertools.islice(changes, MAX_KV_EVENTS))}

    def close(self) -> None:
        """The stream is gone: abort (and free) every request it still has."""
        self.closed = True
        self._ready.set()
        live = list(self.requests)
        for request_id in live:
            self._abort(request_id)
        if live:
            log.info("frontend %s disconnected: aborted its %d live requests", self.peer, len(live))
