"""The step loop: one task that owns the worker connection and the scheduler built for it.

Per worker session: connect and handshake, build a fresh ``SchedulerCore`` (block
pool and scheduler sized from the reply), report ready, then plan → send → await
the result → finish the step → deliver, for as long as there is work. With async scheduling
the next plan is sent before the current result is read, so the worker always
has the next step queued while it runs one (at most two plans are in flight);
a worker of P pipeline stages gets up to P plans over disjoint requests
(``micro_batches``).
Delivery ends with one flush per connected frontend: one message per step each;
frontend streams stay connected whatever happens to the worker.
When the worker's stream breaks, its requests are parked as preempted (blocks
released, prompt and streamed tokens kept, a token in flight discarded; see
``Scheduler.evacuate``), the scheduler is dropped (nothing stale survives) and
the loop dials again: the next worker's scheduler adopts them and resumes them
by recompute. If no worker completes a handshake within
``--worker-reconnect-timeout`` they fail with UNAVAILABLE. When the worker
breaks the protocol, or the step loop itself fails, live requests fail at once
(resuming them could repeat the failure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import grpc

from kvgrid.v1 import scheduler_pb2, worker_pb2
from services.common.config import Config
from services.common.errors import ResourceExhausted, Unavailable
from services.scheduler import plan_steps
from services.scheduler.admission import admit
from services.scheduler.convert import (
    plan_to_proto,
    pooled_from_proto,
    prompt_logprobs_from_proto,
    sampled_from_proto,
)
from services.scheduler.core import SchedulerCore, StepCounters
from services.scheduler.frontends import FrontendRequest, FrontendStream
from services.scheduler.kv_events import KvEventLog
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.micro_batches import MicroBatches
from services.scheduler.request import Request
from services.scheduler.scheduler import WorkerProtocolError
from services.scheduler.step_plan import SchedulerOutput
from services.scheduler.streams import RequestStream
from services.scheduler.worker_link import WorkerSession, connect

log = logging.getLogger(__name__)


class WorkerLost(ConnectionError):
    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(message)
        self.code = code


# How a stream ends when the worker process or the connection went away, rather than the worker failing a step:
# only then are its requests kept for the next worker (a request that makes the worker fail would fail again).
_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Engine:
    def __init__(
        self,
        config: Config,
        metrics: SchedulerMetrics | None = None,
        on_ready: Callable[[bool], None] = lambda ready: None,
    ):
        self.config = config
        self.metrics = metrics
        self._on_ready = on_ready
        self.worker_info: worker_pb2.HandshakeResponse | None = None
        self._core: SchedulerCore | None = None
        # request id -> where its outputs go: a RequestStream (Submit) or a FrontendRequest (Connect).
        self._streams: dict[str, RequestStream | FrontendRequest] = {}
        self.frontends: set[FrontendStream] = set()
        # Plans sent ahead of their results: 2 with async scheduling, 1 without.
        # Speculative decoding plans one step at a time: the next plan needs this one's token count.
        self._max_in_flight = 2 if config.scheduler.async_scheduling and not config.scheduler.speculative else 1
        if config.scheduler.async_scheduling and config.scheduler.speculative:
            log.info("async scheduling is off: speculative decoding plans one step at a time")
        # Requests of a lost worker waiting for the next one (in resume order), and until when they may wait.
        self._parked: list[Request] = []
        self._parked_until = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # Counters of sessions that ended, so GetStats counts since start.
        self._past = StepCounters()
        self._draining = False
        self._kv_events = KvEventLog()

    @property
    def ready(self) -> bool:
        return self._core is not None

    @property
    def num_live(self) -> int:
        """Requests not finished yet (running, waiting, or parked for the next worker)."""
        return len(self._streams)

    def drain(self) -> None:
        """Shutdown began: new requests are refused, live ones go on (see SchedulerServer.stop)."""
        self._draining = True
        self._on_ready(False)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="scheduler-step-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self._fail_parked("the scheduler is shutting down")

    def submit(
        self, msg: scheduler_pb2.SubmitRequest, trace_context: dict[str, str], make_stream=RequestStream
    ) -> RequestStream | FrontendRequest:
        """Admit a request; ``make_stream(request)`` builds where its outputs go. Raises KvgridError."""
        core = self._core
        if self._draining:
            raise Unavailable("the scheduler is shutting down and takes no new requests")
        if core is None:
            raise Unavailable(f"no worker is ready yet (waiting for the worker at {self.config.network.worker_addr})")
        request = admit(msg, core.admission, core.scheduler.requests, core.scheduler.num_waiting)
        request.trace_context = trace_context
        stream = make_stream(request)
        core.scheduler.add_request(request)
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> bool:
        """Abort a live request (its blocks are freed at once); False when none has that id."""
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return False
        if self._core is not None:
            self._core.scheduler.abort_request(request_id)
        self._parked = [request for request in self._parked if request.request_id != request_id]
        stream.abort()
        self._wake.set()
        return True

    def connect(self, peer: str) -> FrontendStream:
        """A new frontend stream; its first message carries the load and every cached block hash."""
        frontend = FrontendStream(peer, self.abort)
        self.frontends.add(frontend)
        core = self._core
        cached = dict.fromkeys(core.scheduler.kv.pool.cached_hashes(), True) if core is not None else {}
        frontend.publish(self.load(), True, cached, self._kv_events.block_size)
        return frontend

    def disconnect(self, frontend: FrontendStream) -> None:
        """The frontend's stream is gone: its live requests are aborted and their blocks freed."""
        self.frontends.discard(frontend)
        frontend.close()

    def release(self, stream: RequestStream) -> None:
        """The caller of ``stream`` is gone: abort its request if it is still live."""
        if not stream.done and self._streams.get(stream.request.request_id) is stream:
            self.abort(stream.request.request_id)

    def load(self) -> scheduler_pb2.GroupLoad:
        if self._core is None:
            return scheduler_pb2.GroupLoad(num_waiting=len(self._parked))
        s = self._core.scheduler
        return scheduler_pb2.GroupLoad(
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv.usage,
            lora_adapters=sorted(s.running_adapters()),
        )

    def _publish(self) -> None:
        """Tell every frontend stream what changed for routing (load, prefix-cache contents) since last time."""
        load, cleared, changes = self._kv_events.take(self.load())
        if load is None and not cleared and not changes:
            return
        for frontend in self.frontends:
            frontend.publish(load, cleared, changes, self._kv_events.block_size)

    def stats(self) -> scheduler_pb2.SchedulerStats:
        core = self._core
        counts = self._past if core is None else self._past + core.counters()
        stats = scheduler_pb2.SchedulerStats(
            prefix_cache_queries=counts.prefix_cache_queries,
            prefix_cache_hits=counts.prefix_cache_hits,
            num_preemptions=counts.num_preemptions,
            num_steps=counts.num_steps,
        )
        if core is None:
            stats.num_waiting = len(self._parked)
            return stats
        s = core.scheduler
        pool = s.kv.pool
        stats.num_running = s.num_running
        stats.num_waiting = s.num_waiting
        stats.num_blocks_total = pool.num_blocks
        stats.num_blocks_used = pool.num_used_blocks
        stats.kv_cache_usage = pool.usage
        stats.worker_ready = True
        stats.num_cached_free_blocks = pool.num_cached_free_blocks
        if s.tiers is not None:
            stats.kv_tiers.extend(s.tiers.stats())
        return stats

    async def _run(self) -> None:
        while True:
            session = await self._connect()
            reason = "the worker connection was lost"  # replaced below by what actually happened
            park = False
            try:
                self._begin(session)
                await self._drive(session)
            except asyncio.CancelledError:
                reason = "the scheduler is shutting down"
                raise
            except (grpc.aio.AioRpcError, WorkerLost, WorkerProtocolError) as e:
                reason = f"the worker stream failed ({_describe(e)})"
                park = _worker_gone(e)
                log.warning("%s; dialing the worker again", reason)
            except Exception as e:
                reason = f"the scheduler's step loop failed ({type(e).__name__}: {e})"
                log.exception("step loop failed; dialing the worker again")
            finally:
                await self._end(session, reason, park)

    async def _connect(self) -> WorkerSession:
        """The next worker; parked requests fail once their wait runs out, and dialing goes on."""
        if self._parked:
            try:
                return await asyncio.wait_for(connect(self.config), self._parked_until - time.monotonic())
            except TimeoutError:
                timeout = self.config.scheduler.worker_reconnect_timeout
                self._fail_parked(f"no worker came back at {self.config.network.worker_addr} within {timeout:g}s")
        return await connect(self.config)

    def _fail_parked(self, reason: str) -> None:
        parked, self._parked = self._parked, []
        for request in parked:
            stream = self._streams.pop(request.request_id, None)
            if stream is not None:
                stream.fail(Unavailable(f"request {request.request_id!r} failed: the worker was lost and {reason}"))

    def _begin(self, session: WorkerSession) -> None:
        info = session.info
        self._core = SchedulerCore.for_worker(info, self.config, self.metrics)
        scheduler = self._core.scheduler
        self._kv_events.reset(info.block_size)
        scheduler.kv.pool.on_event = self._kv_events.record
        parked, self._parked = self._parked, []
        for request in scheduler.adopt(parked):
            stream = self._streams.pop(request.request_id)
            stream.fail(
                ResourceExhausted(
                    f"request {request.request_id!r} failed: it holds {request.num_tokens} tokens, more than the "
                    f"new worker's KV cache can compute again ({scheduler.max_seq_len} tokens)"
                )
            )
        if parked:
            log.info("resuming %d requests of the lost worker by recompute", len(parked))
        self.worker_info = info
        if self.metrics is not None:
            self.metrics.kv_blocks_total.set(info.num_blocks)
        log.info(
            "worker %s ready: model %s, %d blocks of %d tokens, max model length %d; decode steps per plan: %s",
            info.worker_id or "?",
            info.model,
            info.num_blocks,
            info.block_size,
            scheduler.max_seq_len,
            plan_steps.describe(self.config.scheduler.num_scheduler_steps),
        )
        self._on_ready(not self._draining)
        self._publish()

    async def _end(self, session: WorkerSession, reason: str, park: bool) -> None:
        self._on_ready(False)
        core, self._core = self._core, None
        self.worker_info = None
        if core is not None:
            self._past += core.counters()
            if park:
                self._park(core.scheduler.evacuate())
        streams = self._streams
        self._streams = {request.request_id: streams.pop(request.request_id) for request in self._parked}
        for stream in streams.values():
            stream.fail(Unavailable(f"request {stream.request.request_id!r} failed: {reason}"))
        if self.metrics is not None:
            self.metrics.num_running.set(0)
            self.metrics.num_waiting.set(len(self._parked))
            self.metrics.kv_cache_usage.set(0)
        self._kv_events.reset(0)
        self._publish()
        await session.channel.close()

    def _park(self, requests: list[Request]) -> None:
        if not requests:
            return
        timeout = self.config.scheduler.worker_reconnect_timeout
        self._parked, self._parked_until = requests, time.monotonic() + timeout
        log.warning("%d requests wait up to %gs for a worker to resume them", len(requests), timeout)

    async def _drive(self, session: WorkerSession) -> None:
        core = self._core
        call = session.stub.Execute()
        call.add_done_callback(lambda _: self._wake.set())
        in_flight: deque[SchedulerOutput] = deque()
        max_in_flight, micro = self._max_in_flight, None
        if session.info.micro_batches > 1:  # a pipeline: one plan per stage, over disjoint requests
            micro = core.scheduler.micro_batches = MicroBatches(session.info.micro_batches)
            max_in_flight = max(max_in_flight, micro.count)
        try:
            while True:
                if len(in_flight) < max_in_flight and core.scheduler.has_work():
                    out = core.plan()
                    if not out.is_empty:
                        await call.write(plan_to_proto(out))
                        in_flight.append(out)
                        if micro is not None:
                            micro.sent(out)
                        continue
                if not in_flight:
                    self._publish()  # e.g. the load after aborts that needed no step
                    await self._idle(call)
                    continue
                result = await call.read()
                if result is grpc.aio.EOF:
                    raise WorkerLost("the worker closed the Execute stream")
                out = in_flight.popleft()
                if result.step_id != out.step_id:
                    raise WorkerProtocolError(f"result for step {result.step_id}, expected {out.step_id}")
                if micro is not None:
                    micro.done(out)
                sampled, pooled = sampled_from_proto(result), pooled_from_proto(result)
                prompt_logprobs = prompt_logprobs_from_proto(result) if result.prompt_logprobs else ()
                failed = result.num_kv_load_failed_tokens
                outputs = core.finish_step(out, sampled, result.execute_seconds, failed, prompt_logprobs, pooled)
                self._deliver(outputs)
        finally:
            call.cancel()

    async def _idle(self, call: grpc.aio.StreamStreamCall) -> None:
        """Wait for new work; the call's done-callback also wakes this, so a worker lost while idle is seen."""
        self._wake.clear()
        if not call.done():
            await self._wake.wait()
        if call.done():
            code, details = await call.code(), await call.details()
            raise WorkerLost(f"the Execute stream ended ({code.name}: {details or 'no details'})", code)

    def _deliver(self, outputs) -> None:
        streams = self._streams
        for output in outputs:
            request_id = output.request.request_id
            stream = streams.get(request_id)
            if stream is None:
                continue
            stream.push(output)
            if output.finish is not None:
                del streams[request_id]
        self._publish()
        for frontend in self.frontends:
            frontend.flush()


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)


def _worker_gone(e: BaseException) -> bool:
    if isinstance(e, grpc.aio.AioRpcError):
        return e.code() in _GONE
    return isinstance(e, WorkerLost) and e.code in _GONE
