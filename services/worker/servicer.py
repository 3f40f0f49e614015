"""The kvgrid.v1.Worker servicer: thin; plans go to the request states and the runner."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from opentelemetry import trace

from kvgrid.v1 import worker_pb2, worker_pb2_grpc
from services.common import tracing
from services.common.errors import FailedPrecondition, Unavailable, grpc_errors
from services.worker.core import WorkerCore
from services.worker.metrics import WorkerMetrics
from services.worker.model_runner import SampledRow
from services.worker.parallel.micro_batches import MicroBatchPipeline
from services.worker.request_state import RequestState, RequestStates
from services.worker.sampling import prompt_logprobs

log = logging.getLogger(__name__)

# How long a new Execute stream waits for the open one to end before it is refused: a scheduler that redials
# after its stream broke may arrive before the worker has seen the old stream end.
STREAM_WAIT_S = 1.0


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, metrics: WorkerMetrics | None = None):
        self.core: WorkerCore | None = None
        self.metrics = metrics
        # One thread runs the model: loading (see server.start_worker) and every step. Streams share the
        # device and the KV cache, so steps never overlap; and OpenMP keeps one thread team per calling
        # thread: with a second team alive (loading on another thread) libgomp finds more threads than
        # cores and stops spin-waiting between parallel regions, so each of a step's many short regions pays a
        # thread wake-up, which small decode steps feel most.
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-model")
        # The request states of the open Execute stream, so that a drain knows when they are done.
        self._open: list[RequestStates] = []
        # One plan stream at a time, and only from the peer of the last handshake: the KV cache is the block pool
        # of one scheduler, and a second stream could write into blocks that pool gave to other requests.
        self._stream_lock = asyncio.Lock()
        self._scheduler_peer: str | None = None
        self.draining = False

    @property
    def num_requests(self) -> int:
        """Requests held on all open Execute streams."""
        return sum(len(states.requests) for states in self._open)

    def attach(self, core: WorkerCore) -> None:
        self.core = core

    def _ready(self) -> WorkerCore:
        if self.core is None:
            raise Unavailable("the worker is still loading the model")
        return self.core

    @grpc_errors
    async def Handshake(self, request, context):
        core = self._ready()
        if self.draining:
            raise Unavailable("the worker is shutting down; dial its replacement")
        if core.ranks is not None and not core.ranks.alive:
            raise Unavailable("a tensor-parallel rank is gone and the worker is going down; dial its replacement")
        self._scheduler_peer = context.peer()
        log.info("handshake from scheduler %r at %s", request.scheduler_id or "?", self._scheduler_peer)
        return core.handshake

    async def _take_stream(self, context) -> None:
        """Become the one open plan stream, or raise FailedPrecondition."""
        if self._scheduler_peer is None or context.peer() != self._scheduler_peer:
            raise FailedPrecondition(
                "Execute: only the scheduler of the last Handshake may send plans; call Handshake first on this"
                " connection"
            )
        try:
            await asyncio.wait_for(self._stream_lock.acquire(), STREAM_WAIT_S)
        except TimeoutError:
            raise FailedPrecondition(
                "Execute: another plan stream is open; a worker takes plans from one scheduler at a time (its KV"
                " blocks belong to that scheduler's pool)"
            ) from None

    @grpc_errors
    async def Execute(self, request_iterator, context):
        core = self._ready()
        await self._take_stream(context)
        states = None
        spans = _RequestSpans()
        try:
            states = core.request_states()
            log.info("execute stream opened")
            self._open.append(states)
            if core.handshake.micro_batches > 1:
                steps = self._pipelined(core, states, spans, request_iterator)
            else:
                steps = self._one_at_a_time(core, states, spans, request_iterator)
            async for result in steps:
                yield result
        finally:
            self._stream_lock.release()
            if states is not None:
                self._open.remove(states)
                log.info("execute stream closed with %d requests in flight", len(states.requests))
            spans.end(list(spans.open))

    def _accept(self, core: WorkerCore, states: RequestStates, spans: _RequestSpans, plan) -> list[RequestState]:
        """The plan's requests as the worker holds them, ready to run (on the event loop, in plan order)."""
        spans.end(plan.finished_ids)
        core.check_plan(plan)
        scheduled = states.apply(plan)
        spans.start(plan.new_requests)
        spans.step(scheduled, max(plan.num_steps, 1))
        return scheduled

    def _result(self, plan, scheduled, rows: list[SampledRow], num_failed: int, started: float):
        seconds = time.perf_counter() - started
        if self.metrics is not None:
            self.metrics.record_step(seconds, max(plan.num_steps, 1))
        return worker_pb2.StepResult(
            step_id=plan.step_id,
            sampled=[_sampled(row) for row in rows if row.pooled is None],
            execute_seconds=seconds,
            num_kv_load_failed_tokens=num_failed,
            prompt_logprobs=prompt_logprobs.take(scheduled),
            pooled=[_pooled(row) for row in rows if row.pooled is not None],
        )

    async def _one_at_a_time(self, core: WorkerCore, states, spans, plans):
        loop = asyncio.get_running_loop()
        async for plan, fetches in _fetching_ahead(core, plans):
            started = time.perf_counter()
            scheduled = self._accept(core, states, spans, plan)
            rows, num_failed = await loop.run_in_executor(self.model_thread, core.execute, plan, scheduled, fetches)
            yield self._result(plan, scheduled, rows, num_failed, started)

    async def _pipelined(self, core: WorkerCore, states, spans, plans):
        """Pipeline stages: plans over disjoint requests join the pipeline as they arrive (see
        services/worker/parallel/micro_batches.py); the oldest completes when no plan waits or the pipeline is
        full. Results leave in plan order."""
        loop = asyncio.get_running_loop()
        pipe = MicroBatchPipeline(core.runner, core.handshake.micro_batches)
        arrived: asyncio.Queue = asyncio.Queue()

        async def pump() -> None:
            try:
                async for plan in plans:
                    arrived.put_nowait(plan)
                arrived.put_nowait(None)
            except Exception as exc:  # the stream broke: raised where the plans are taken
                arrived.put_nowait(exc)

        pumping = asyncio.create_task(pump(), name="worker-plan-reader")
        ended = False
        try:
            while not ended or pipe.pending:
                if pipe.pending and (ended or pipe.full or arrived.empty()):
                    step, rows = await loop.run_in_executor(self.model_thread, pipe.complete)
                    yield self._result(step.plan, step.scheduled, rows, 0, step.started)
                    continue
                plan = await arrived.get()
                if plan is None:
                    ended = True
                    continue
                if isinstance(plan, Exception):
                    raise plan
                started = time.perf_counter()
                scheduled = self._accept(core, states, spans, plan)
                if pipe.takes(plan, scheduled):
                    await loop.run_in_executor(self.model_thread, pipe.launch, plan, scheduled, started)
                    continue
                while pipe.pending:  # a plan that shares requests with the pipeline, or of several steps
                    step, rows = await loop.run_in_executor(self.model_thread, pipe.complete)
                    yield self._result(step.plan, step.scheduled, rows, 0, step.started)
                rows, num_failed = await loop.run_in_executor(self.model_thread, core.execute, plan, scheduled)
                yield self._result(plan, scheduled, rows, num_failed, started)
        finally:
            pumping.cancel()
            # Plans still in the pipeline (the stream ended or broke): their outputs are taken off the last stage
            # before the next stream's plans run; queued on the model thread, after a launch it may be running.
            self.model_thread.submit(pipe.drain)

    def shutdown(self) -> None:
        self.model_thread.shutdown(wait=False, cancel_futures=True)


async def _fetching_ahead(core: WorkerCore, plans):
    """``(plan, fetches)`` in plan order, the plan's Redis loads already being fetched (``WorkerCore.prefetch``).

    Plans are read off the stream as they arrive rather than when the previous step is done: with async
    scheduling the next plan comes while this one runs, so its network round trip overlaps this step."""
    if not core.fetches_ahead:
        async for plan in plans:
            yield plan, None
        return
    arrived: asyncio.Queue = asyncio.Queue()  # (plan, fetches), then None at the stream's end or its error

    async def read() -> None:
        try:
            async for plan in plans:
                arrived.put_nowait((plan, core.prefetch(plan)))
        except BaseException as exc:  # handed to the consumer, which raises it in the stream's task
            arrived.put_nowait(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            arrived.put_nowait(None)

    reader = asyncio.create_task(read(), name="worker-plan-reader")
    try:
        while (item := await arrived.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        reader.cancel()


def _sampled(row: SampledRow) -> worker_pb2.SampledToken:
    out = worker_pb2.SampledToken(request_id=row.request.request_id, token_id=row.token_id)
    if row.logprob is not None:
        out.logprob.CopyFrom(row.logprob)
    return out


def _pooled(row: SampledRow) -> worker_pb2.PooledOutput:
    return worker_pb2.PooledOutput(request_id=row.request.request_id, data=row.pooled)


class _RequestSpans:
    """One span per request for its life on this stream, child of the scheduler's request span.

    A recorded span counts the request's steps (attribute ``kvgrid.num_steps``) and gets one
    ``prefill`` event per step that computes more than one of its tokens (a prompt or a chunk of it).
    """

    def __init__(self):
        self.open: dict[str, trace.Span] = {}
        # Steps of each request whose span records; empty when tracing is off, so ``step`` costs nothing.
        self.num_steps: dict[str, int] = {}

    def start(self, new_requests) -> None:
        tracer = tracing.tracer()
        for new in new_requests:
            self.end([new.request_id])
            span = tracer.start_span(
                "worker.request",
                context=tracing.extract(new.trace_context),
                attributes={
                    "kvgrid.request_id": new.request_id,
                    "kvgrid.num_prompt_tokens": new.num_prompt_tokens,
                    "kvgrid.num_computed_tokens": new.num_computed_tokens,
                },
            )
            self.open[new.request_id] = span
            if span.is_recording():
                self.num_steps[new.request_id] = 0

    def step(self, scheduled: list[RequestState], num_steps: int = 1) -> None:
        """Call with a plan's requests before it runs (their tokens to compute are set, not yet computed); a plan
        of several decode steps counts that many."""
        if not self.num_steps:
            return
        for state in scheduled:
            count = self.num_steps.get(state.request_id)
            if count is None:
                continue
            self.num_steps[state.request_id] = count + num_steps
            if state.num_scheduled_tokens > 1:
                attributes = {
                    "kvgrid.num_tokens": state.num_scheduled_tokens,
                    "kvgrid.start": state.num_computed_tokens,
                }
                self.open[state.request_id].add_event("prefill", attributes)

    def end(self, request_ids) -> None:
        for request_id in request_ids:
            span = self.open.pop(request_id, None)
            if span is not None:
                count = self.num_steps.pop(request_id, None)
                if count is not None:
                    span.set_attribute("kvgrid.num_steps", count)
                span.end()
