"""The shared Redis KV tier, worker side: one key per block, written in the background, read in one pipelined trip.

Writes never stall a step: the step only copies the blocks to host memory and queues them; a writer
thread hashes them and sends them from that copy (SET NX: a key already there is left alone). When the queue is full
(Redis slower than the saves), a batch is dropped and counted. A load sends MGETs of ``BLOCKS_PER_TRIP``
blocks (256 tokens at block size 16) together in one pipeline, so a prompt's blocks come back in one
round trip, read straight into a receive buffer (``raw_resp``) that the tier keeps for the next load once
the blocks are copied out (``release``): a fresh buffer per load would fault its pages in every time, and
``start_prefault`` faults the first one in at startup, so the first load after start is not the slowest.
Each value's hash is checked (XXH3, tens of GB/s) and the caller copies the blocks into their cache blocks
(spread over a few threads: ``map``). The first block that is missing or does not decode ends the load (the
rest of the prompt is recomputed).

``prefetch`` runs a load on a fetcher thread: it only reads Redis into host memory, never the cache, so it
may start as soon as a plan arrives, while the step before it still runs; the plan's step copies what
came back into its blocks, in plan order.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.common.cpu_quota import usable_cores
from services.worker.kv_cache import lazily_zeroed
from services.worker.kv_transfer import layout, raw_resp
from services.worker.kv_transfer.host import populate

log = logging.getLogger(__name__)

BLOCKS_PER_TRIP = 16
MAX_QUEUED_BATCHES = 64
MAX_COPY_THREADS = 8
VALUE_HEADER_BYTES = 1024  # room for a value's header (``layout``) and its reply line, per block, in a buffer
MAX_PREFAULT_BYTES = 256 << 20


@dataclass
class Loaded:
    """The blocks of one load (views of ``buffer``), to copy out before ``RedisTier.release``."""

    blocks: list[torch.Tensor]
    buffer: np.ndarray | None = field(default=None, repr=False)


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
        self._copiers = ThreadPoolExecutor(min(usable_cores(), MAX_COPY_THREADS), "kv-redis-copy")
        self._fetcher = ThreadPoolExecutor(1, "kv-redis-fetch")  # one at a time: plans need them in order
        self.block_bytes = int(np.prod(block_shape)) * dtype.itemsize
        self._spare: np.ndarray | None = None  # the receive buffer of a load whose blocks were copied out
        self._spare_lock = threading.Lock()

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

    def prefetch(self, keys: list[str]) -> Future[Loaded]:
        """``load(keys)`` on the fetcher thread."""
        return self._fetcher.submit(self.load, keys)

    def map(self, fn: Callable, items: Iterable) -> Iterator:
        """``fn`` over ``items`` on the copy threads (GIL-free work: numpy copies), results in order."""
        return self._copiers.map(fn, items)

    def start_prefault(self, num_blocks: int) -> threading.Thread:
        """Fault in, on a background thread, a receive buffer for loads of up to ``num_blocks`` blocks (at most
        ``MAX_PREFAULT_BYTES``; a larger load grows it once)."""
        nbytes = min(num_blocks * (self.block_bytes + VALUE_HEADER_BYTES), MAX_PREFAULT_BYTES)
        thread = threading.Thread(target=self._prefault, args=(nbytes,), name="kv-redis-prefault", daemon=True)
        thread.start()
        return thread

    def _prefault(self, nbytes: int) -> None:
        buffer = _fresh(nbytes)
        try:
            populate(buffer.ctypes.data, nbytes)
        except OSError:
            buffer[::4096] = 0  # one write per page, where the kernel cannot populate a range
        self.release(Loaded([], buffer))

    def release(self, loaded: Loaded) -> None:
        """``loaded``'s blocks were copied out (and are not used again): its buffer serves the next load."""
        buffer, loaded.buffer, loaded.blocks = loaded.buffer, None, []
        with self._spare_lock:
            if buffer is not None and (self._spare is None or len(buffer) > len(self._spare)):
                self._spare = buffer

    def _buffer(self, nbytes: int) -> np.ndarray:
        """The spare receive buffer if it holds ``nbytes``, else a fresh one (which ``release`` keeps)."""
        with self._spare_lock:
            if self._spare is not None and len(self._spare) >= nbytes:
                buffer, self._spare = self._spare, None
                return buffer
        return _fresh(nbytes)

    def load(self, keys: list[str]) -> Loaded:
        """The blocks of the longest prefix of ``keys`` that Redis holds and that decode as asked."""
        trips = [keys[start : start + BLOCKS_PER_TRIP] for start in range(0, len(keys), BLOCKS_PER_TRIP)]
        out = Loaded([], self._buffer(len(keys) * (self.block_bytes + VALUE_HEADER_BYTES)))
        failed: str | None = None
        try:
            with self._socket() as (conn, sock):
                conn.send_packed_command(conn.pack_commands([("MGET", *trip) for trip in trips]))
                values = raw_resp.Replies(sock, out.buffer, _fresh).mget([len(trip) for trip in trips])
                for key, value in zip(keys, values, strict=True):  # each checked while the next ones arrive
                    if failed is None:  # after a failure, the rest is read (the connection stays in step)
                        failed = self._check(key, value, out.blocks)
        except Exception as exc:  # noqa: BLE001 - any client, connection or reply error: recompute
            log.warning("redis KV tier: load failed (%s: %s); recomputing", type(exc).__name__, exc)
            self.on_failure("load")
            self.release(out)
            return Loaded([])
        if failed is not None:
            self.on_failure(failed)
        return out

    def _check(self, key: str, value: memoryview | None, blocks: list[torch.Tensor]) -> str | None:
        """Append the block in ``value`` to ``blocks``; or why it cannot be loaded."""
        if value is None:
            return "missing"
        try:
            blocks.append(layout.decode(value, key, self.namespace, self.block_shape, self.dtype))
            return None
        except layout.BadBlock as exc:
            log.warning("redis KV tier: %s rejected (%s); recomputing", key, exc)
            self._delete(key)
            return "rejected"

    @contextlib.contextmanager
    def _socket(self):
        """A connection of the client's pool (connected, authenticated) and its socket, past redis-py's parser
        (which holds nothing between commands); dropped if a command or its reply fails halfway."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            yield conn, conn._sock
        except BaseException:
            conn.disconnect()  # a reply read halfway leaves the rest on the socket
            raise
        finally:
            pool.release(conn)

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
                errors = self._send(keys, blocks)
                if errors:
                    log.warning("redis KV tier: %d of %d blocks not saved (%s)", len(errors), len(keys), errors[0])
                    self.on_failure("save")
            except Exception as exc:  # noqa: BLE001 - Redis down or full: the blocks are simply not shared
                log.warning("redis KV tier: save of %d blocks failed (%s: %s)", len(keys), type(exc).__name__, exc)
                self.on_failure("save")
            finally:
                self._queue.task_done()

    def _send(self, keys: list[str], blocks: torch.Tensor) -> list[str]:
        """SET NX of every block, sent from the blocks' own memory; the errors Redis answered."""
        values = [layout.split_encode(key, self.namespace, blocks[j]) for j, key in enumerate(keys)]
        with self._socket() as (_, sock):
            raw_resp.send_sets(sock, keys, values)
            return raw_resp.Replies(sock, np.empty(1 << 12, np.uint8), _fresh).set_errors(len(keys))


def _fresh(nbytes: int) -> np.ndarray:
    """A receive buffer of its own pages: page-aligned, as ``populate`` needs, and huge pages where the kernel
    gives them."""
    return lazily_zeroed((nbytes,), torch.uint8).numpy()
