"""The frontend's one link to the scheduler: submit a tokenized request, iterate its deltas, abort it.

The gRPC servicer, the OpenAI routes and group routing all go through an
``EngineClient``; the one for a single scheduler is ``SchedulerClient``. Its
transport is one ``Scheduler.Connect`` stream: submits and aborts go out batched
(one message per event-loop turn), and once per step the
scheduler sends one message with the deltas of all of this frontend's requests.
That message is processed in one pass (``RequestHandle.transform`` runs there:
detokenize, stop strings), in chunks so that a large batch never holds the
event loop for long, and fanned out to the waiting calls. When the stream
breaks, every call in flight fails with UNAVAILABLE and the stream is dialed
again with backoff. Errors surface as ``KvgridError`` subclasses carrying the
scheduler's status code, never as raw ``AioRpcError``. The load and prefix-cache
news the scheduler sends on the same stream keep ``view`` current for routing;
with several worker groups, ``services.tokenizer.router.Router`` holds one
``SchedulerClient`` per scheduler and offers the same submit interface.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import grpc

from kvgrid.v1 import common_pb2, scheduler_pb2
from services.common.errors import AlreadyExists, Unavailable, error_for_code
from services.common.tls import TlsFiles
from services.tokenizer.group_view import GroupView
from services.tokenizer.model_state import ModelState
from services.tokenizer.request_handle import RequestHandle
from services.tokenizer.upstream import INITIAL_BACKOFF_S, MAX_BACKOFF_S, SchedulerLink

log = logging.getLogger(__name__)


class EngineClient(Protocol):
    """What the request pipeline needs of its link to the schedulers: a ``SchedulerClient`` (one scheduler) or a
    ``Router`` (every group of the deployment)."""

    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        trace_context: dict[str, str],
        pooling: common_pb2.PoolingParams | None = None,
        mm_inputs: list[common_pb2.MultiModalInput] = (),
        lora: common_pb2.LoraRequest | None = None,
        deliver_at_finish: bool = False,
    ) -> RequestHandle: ...

    def abort(self, request_id: str) -> None: ...


# How long a submit waits for the stream to (re)connect before failing with UNAVAILABLE.
CONNECT_WAIT_S = 5.0
# A step's deltas are dispatched in one pass up to UNCHOPPED of them: the calls' writes then reach the transport
# together (fewer syscalls). Past that, a yield to the event loop every CHUNK deltas keeps loop iterations short,
# because grpc's aio server accepts a new call only after several iterations (one pending accept per method):
# long iterations had capped admission at about one call per step at 256 concurrent calls.
UNCHOPPED = 64
CHUNK = 4


class SchedulerClient:
    """Owns the Connect stream to the scheduler at ``addr`` and keeps ``state`` in step with its health (dialed
    with mutual TLS when ``tls`` is given, see ``SchedulerLink``)."""

    def __init__(self, addr: str, state: ModelState, tls: TlsFiles | None = None, server_name: str = ""):
        self.addr = addr
        self.link = SchedulerLink(addr, state, tls, server_name)
        self.view = GroupView()
        self._handles: dict[str, RequestHandle] = {}
        # Outgoing messages not written yet; submits after an abort start a new message, so order is kept.
        self._outbox: list[scheduler_pb2.FrontendMessage] = []
        self._wake_writer = asyncio.Event()
        self._connected = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def has(self, request_id: str) -> bool:
        return request_id in self._handles

    def start(self) -> None:
        self.link.start()
        self._task = asyncio.create_task(self._run(), name="scheduler-connect")

    async def close(self, reason: str = "the frontend is shutting down") -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._fail_all(reason)
        await self.link.close()

    async def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        trace_context: dict[str, str],
        pooling: common_pb2.PoolingParams | None = None,
        mm_inputs: list[common_pb2.MultiModalInput] = (),
        lora: common_pb2.LoraRequest | None = None,
        deliver_at_finish: bool = False,
    ) -> RequestHandle:
        """Start ``request_id``; ``sampling`` is the scheduler-facing form (``EngineRequest.scheduler_sampling``);
        ``pooling`` makes it a pooling request (its one delta carries the vector); ``deliver_at_finish``: see
        ``SubmitRequest``."""
        if request_id in self._handles:
            raise AlreadyExists(f"request_id: a live request already has id {request_id!r}")
        if not self._connected.is_set():
            try:
                await asyncio.wait_for(self._connected.wait(), CONNECT_WAIT_S)
            except TimeoutError:
                raise Unavailable(f"no stream to the scheduler at {self.addr}") from None
        handle = RequestHandle(self, request_id)
        self._handles[request_id] = handle
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=sampling,
            trace_context=trace_context,
            pooling=pooling,
            mm_inputs=mm_inputs,
            lora=lora,
            deliver_at_finish=deliver_at_finish,
        )
        if not self._outbox or self._outbox[-1].aborts:
            self._outbox.append(scheduler_pb2.FrontendMessage())
        self._outbox[-1].submits.append(submit)
        self._wake_writer.set()
        return handle

    def abort(self, request_id: str) -> None:
        """Abort ``request_id`` at the scheduler, fire-and-forget; safe from a cancelled task."""
        handle = self._handles.pop(request_id, None)
        if handle is None or not self._connected.is_set():
            return  # finished already, or its stream broke (the scheduler aborted it then)
        if not self._outbox:
            self._outbox.append(scheduler_pb2.FrontendMessage())
        self._outbox[-1].aborts.append(request_id)
        self._wake_writer.set()

    async def _run(self) -> None:
        backoff = INITIAL_BACKOFF_S
        while True:
            call = self.link.stub.Connect()
            writer = None
            try:
                await call.wait_for_connection()
                self._connected.set()
                backoff = INITIAL_BACKOFF_S
                log.info("stream to the scheduler at %s open", self.addr)
                writer = asyncio.create_task(self._write(call), name="scheduler-connect-writer")
                async for message in call:
                    await self._dispatch(message)
                reason = "the scheduler ended the stream"
            except grpc.aio.AioRpcError as e:
                reason = f"{e.code().name}: {e.details()}"
            finally:
                self._connected.clear()
                self.view.reset()
                if writer is not None:
                    writer.cancel()
                call.cancel()
            self._fail_all(f"the stream to the scheduler at {self.addr} broke ({reason})")
            level = logging.WARNING if writer is not None else logging.INFO
            log.log(level, "scheduler stream: %s; retrying in %.1fs", reason, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _write(self, call) -> None:
        try:
            while True:
                await self._wake_writer.wait()
                self._wake_writer.clear()
                while self._outbox:
                    await call.write(self._outbox.pop(0))
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            log.debug("scheduler stream: write failed (%s); the reader sees the break", e)

    async def _dispatch(self, message: scheduler_pb2.SchedulerMessage) -> None:
        """One step's deltas: each goes through its handle's transform and on to the waiting call."""
        if message.HasField("load") or message.HasField("kv_events"):
            self.view.apply(message)
        handles = self._handles
        for i, delta in enumerate(message.deltas):
            if i >= UNCHOPPED and i % CHUNK == 0:
                await asyncio.sleep(0)
            handle = handles.get(delta.request_id)
            if handle is None:
                continue  # aborted here already
            if delta.error_code:
                del handles[delta.request_id]
                code = _CODES.get(delta.error_code, grpc.StatusCode.UNKNOWN)
                handle.fail(error_for_code(code, f"scheduler at {self.addr}: {delta.error_message}"))
                continue
            if delta.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED:
                handle.deliver(delta)
            else:
                del handles[delta.request_id]
                handle.done_upstream = True
                handle.deliver(delta)
                handle.end()

    def _fail_all(self, reason: str) -> None:
        handles, self._handles = self._handles, {}
        self._outbox.clear()
        for handle in handles.values():
            handle.done_upstream = True
            handle.fail(Unavailable(f"request {handle.request_id!r} failed: {reason}"))


_CODES = {code.value[0]: code for code in grpc.StatusCode}
