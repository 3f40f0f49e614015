"""The shared Redis KV tier, worker side: one key per block, written in the background, read in one pipelined trip.

Writes never stall a step: the step only copies the blocks to host memory and queues them; a writer
thread encodes them and sends them (SET NX: a key already there is left alone). When the queue is full
(Redis slower than the saves), a batch is dropped and counted. A load sends MGETs of ``BLOCKS_PER_TRIP``
blocks (256 tokens at block size 16) together in one pipeline, so a prompt's blocks come back in one
round trip; a few threads check the values at once (CRC-32, which zlib computes without the GIL), and
the caller copies them into their cache blocks (on the same threads: ``map``). The first block that is
missing or does not decode ends the load (the rest of the prompt is recomputed).

``prefetch`` runs a load on a fetcher thread: it only reads Redis into host memory, never the cache, so it
may start as soon as a plan arrives, while the step before it still runs; the plan's step copies what
came back into its blocks, in plan order.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from services.worker.kv_transfer import layout

log = logging.getLogger(__name__)

BLOCKS_PER_TRIP = 16
MAX_QUEUED_BATCHES = 64
MAX_CHECK_THREADS = 8


class RedisTier:
    def __init__(
        self,
        client: Any,
        namespace: str,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        on_failure: Callable[[str], None] = lambda op: None,
    ):
        self.client = client
        self.namespace = namespace
        self.block_shape = block_shape
        self.dtype = dtype
        self.on_failure = on_failure
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED_BATCHES)
        self._writer = threading.Thread(target=self._write_loop, name="kv-redis-writer", daemon=True)
        self._writer.start()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self._checkers = ThreadPoolExecutor(min(cores, MAX_CHECK_THREADS), "kv-redis-check")
        self._fetcher = ThreadPoolExecutor(1, "kv-redis-fetch")  # one at a time: plans need them in order

    def save(self, keys: list[str], blocks: torch.Tensor) -> bool:
        """Queue ``blocks`` [n, layers, 2, ...] (a CPU copy the caller no longer touches) under ``keys``."""
        try:
            self._queue.put_nowait((keys, blocks))
            return True
        except queue.Full:
            log.warning("redis KV tier: %d blocks dropped, the writer is behind", len(keys))
            self.on_failure("save")
            return False

    def flush(self) -> None:
        """Wait until every queued block was sent (or failed)."""
        self._queue.join()

    def prefetch(self, keys: list[str]) -> Future[list[torch.Tensor]]:
        """``load(keys)`` on the fetcher thread."""
        return self._fetcher.submit(self.load, keys)

    def map(self, fn: Callable, items: Iterable) -> Iterator:
        """``fn`` over ``items`` on the check threads (GIL-free work: CRC-32, numpy copies), results in order."""
        return self._checkers.map(fn, items)

    def load(self, keys: list[str]) -> list[torch.Tensor]:
        """The blocks of the longest prefix of ``keys`` that Redis holds and that decode as asked (views of the
        values Redis sent)."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for start in range(0, len(keys), BLOCKS_PER_TRIP):
                pipe.mget(keys[start : start + BLOCKS_PER_TRIP])
            values = [value for trip in pipe.execute() for value in trip]
        except Exception as exc:  # noqa: BLE001 - any client or connection error: recompute
            log.warning("redis KV tier: load failed (%s: %s); recomputing", type(exc).__name__, exc)
            self.on_failure("load")
            return []

        def check(i: int) -> torch.Tensor | str:
            """Block i, or why it cannot be loaded."""
            if values[i] is None:
                return "missing"
            try:
                return layout.decode(values[i], keys[i], self.namespace, self.block_shape, self.dtype)
            except layout.BadBlock as exc:
                log.warning("redis KV tier: %s rejected (%s); recomputing", keys[i], exc)
                self._delete(keys[i])
                return "rejected"

        out: list[torch.Tensor] = []
        for block in self.map(check, range(len(keys))):
            if isinstance(block, str):
                self.on_failure(block)
                break
            out.append(block)
        return out

    def _delete(self, key: str) -> None:
        """A value that does not decode is dropped, so the block is written again once recomputed."""
        try:
            self.client.delete(key)
        except Exception:  # noqa: BLE001, S110 - best effort
            pass

    def _write_loop(self) -> None:
        while True:
            keys, blocks = self._queue.get()
            try:
                pipe = self.client.pipeline(transaction=False)
                for j, key in enumerate(keys):
                    pipe.set(key, layout.encode(key, self.namespace, blocks[j]), nx=True)
                pipe.execute()
            except Exception as exc:  # noqa: BLE001 - Redis down or full: the blocks are simply not shared
                log.warning("redis KV tier: save of %d blocks failed (%s: %s)", len(keys), type(exc).__name__, exc)
                self.on_failure("save")
            finally:
                self._queue.task_done()
