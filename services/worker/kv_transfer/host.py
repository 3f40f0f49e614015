"""The host-memory KV tier: ``num_slots`` block-sized slots in (pinned, on CUDA) host memory, laid out like the cache
([layers, 2, num_slots, ...]) so that a run of blocks moves with one copy each way (``blocks.CacheBlocks``).

The scheduler owns the slot map (``services.scheduler.kv_tiers.HostIndex``); this only copies.

On CPU the slots are fresh anonymous pages (``lazily_zeroed``), so the first save into a slot would pay the
kernel's page faults (several times the copy itself). ``start_prefault`` has a background thread fault them
in, a chunk at a time, with ``madvise(MADV_POPULATE_WRITE)``: the kernel maps each page writable without writing to it,
so a save that lands in a chunk before (or while) the thread reaches it is neither lost nor slowed by
more than its own faults. Pinned slots (CUDA) are resident from the start.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import threading

import torch

from services.worker.kv_cache import lazily_zeroed
from services.worker.kv_transfer.blocks import CacheBlocks, KvCaches, block_shape

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # Linux >= 5.14: <linux/mman.h>
PREFAULT_CHUNK_BYTES = 64 << 20  # one madvise call: short enough that the thread yields the CPU often


class HostTier:
    def __init__(self, kv_caches: KvCaches, num_slots: int):
        self.cache = CacheBlocks(kv_caches)
        layers, two, *rest = block_shape(kv_caches)
        k0 = kv_caches[0][0]
        shape = (layers, two, num_slots, *rest)  # [layers, 2, num_slots, block_size, kv_heads, head_dim]
        self.pinned = k0.device.type == "cuda"
        if self.pinned:
            self.slots = torch.empty(shape, dtype=k0.dtype, pin_memory=True)
        else:
            # Fresh pages (``lazily_zeroed``), as the KV cache itself, never a torch.empty of the tier's size: that
            # slows every later model step on CPU, as the host side of benchmarks/kv_tiers_bench.py shows.
            self.slots = lazily_zeroed(shape, k0.dtype)
        self.bytes_per_block = k0[0].numel() * k0.element_size() * 2 * layers
        # Set once every slot's page is resident (at once where there is nothing to fault in).
        self.prefaulted = threading.Event()
        if self.pinned:
            self.prefaulted.set()

    @property
    def num_slots(self) -> int:
        return self.slots.shape[2]

    def start_prefault(self) -> threading.Thread | None:
        """Fault the slots' pages in on a background thread (``prefaulted`` is set when done); None when there
        is nothing to do."""
        if self.prefaulted.is_set():
            return None
        thread = threading.Thread(target=self.prefault, name="kv-host-prefault", daemon=True)
        thread.start()
        return thread

    def prefault(self, chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> bool:
        """Fault every slot's page in, ``chunk_bytes`` at a time; False (and the pages fault on first use, as
        without it) where the kernel cannot populate ranges."""
        start = self.slots.data_ptr()
        end = start + self.slots.numel() * self.slots.element_size()
        page = mmap.PAGESIZE
        start -= start % page  # page-aligned already (its own mapping)
        try:
            for at in range(start, end, chunk_bytes):
                populate(at, min(chunk_bytes, end - at))
        except OSError as exc:
            log.info("host KV tier: slots not pre-faulted (%s); the first saves into them fault pages in", exc)
            return False
        finally:
            self.prefaulted.set()
        return True

    def save(self, block_ids: list[int], slots: list[int]) -> None:
        # Queued behind this step's earlier device work and ahead of the forward pass that may overwrite the blocks.
        self.cache.read(block_ids, self.slots, slots, non_blocking=True)

    def load(self, slots: list[int], block_ids: list[int]) -> None:
        self.cache.write(block_ids, self.slots, slots, non_blocking=True)


def populate(address: int, length: int) -> None:
    """Map the pages of ``[address, address + length)`` (``address`` page-aligned) writable, contents unchanged;
    raises OSError where the kernel cannot (older than 5.14, or not Linux)."""
    madvise = _madvise()
    if madvise is None:
        raise OSError("madvise is not available")
    if madvise(address, length, MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"madvise(MADV_POPULATE_WRITE): {os.strerror(errno)}")


@functools.cache
def _madvise():
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
