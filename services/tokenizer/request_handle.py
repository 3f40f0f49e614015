"""One submitted request as the frontend sees it: an async iterator over what the engine client delivers."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.common.errors import KvgridError

if TYPE_CHECKING:
    from services.tokenizer.engine_client import SchedulerClient

_END = object()


class RequestHandle:
    """Yields the request's scheduler deltas (``token_ids``, ``finish_reason``, ``logprobs``,
    ``num_prompt_tokens``, ``num_cached_tokens``), the last with ``finish_reason`` set; or, when ``transform`` is
    set, whatever it returns for each delta (it runs in the client's one pass over a step's batch). Raises the
    request's KvgridError.

    ``final_only``: the reader is woken by the last delta (one whose transformed value has a ``finish_reason``),
    the end or an error, not by every delta; what came before waits in the queue for ``ready``. A caller that
    answers once (a completion that is not streamed) then costs no task wake-up per step."""

    def __init__(self, client: SchedulerClient, request_id: str):
        self.request_id = request_id
        self._client = client
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # looked up once: on 3.11 each lookup is a getpid()
        self.transform: Callable[[Any], Any] | None = None
        self.final_only = False
        # True once the scheduler no longer holds the request (it finished it, failed it, or we aborted it).
        self.done_upstream = False

    def deliver(self, delta) -> None:
        if self.transform is not None:
            try:
                delta = self.transform(delta)
            except Exception as e:  # noqa: BLE001 - raised in the consumer, not in the client's dispatch loop
                self.close()
                self._put(e)
                return
        if self.final_only and not getattr(delta, "finish_reason", None):
            self._items.append(delta)  # read with the last one
            return
        self._put(delta)

    def fail(self, error: KvgridError) -> None:
        self._put(error)

    def end(self) -> None:
        """The last delta was delivered: iteration stops after it."""
        self._put(_END)

    def _put(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self):
        while not self._items:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            self._items.appendleft(_END)
            raise item
        if item is _END:
            self._items.appendleft(_END)
            raise StopAsyncIteration
        return item

    def ready(self) -> list:
        """Items delivered and not read yet (taken now; an error stays queued for the next read)."""
        if not self._items:
            return []
        taken = []
        while self._items and not isinstance(self._items[0], BaseException) and self._items[0] is not _END:
            taken.append(self._items.popleft())
        return taken

    async def stop(self) -> None:
        """End the request upstream. The abort travels in order with later submits on the one stream, so a request
        reusing the id at once is neither refused nor hit by it."""
        self.close()

    def close(self) -> None:
        """End the request upstream without waiting; synchronous, so it works from a cancelled task."""
        if self.done_upstream:
            return
        self.done_upstream = True
        self._client.abort(self.request_id)
