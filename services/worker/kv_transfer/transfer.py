"""Running a step plan's KV tier moves: saves first, then loads, both before the forward pass.

Order matters: a save reads a device block that this plan's loads or forward pass may overwrite (the
block was evicted and handed to another request), so every save is done first; a load then fills the
request's fresh blocks. A load that fails turns into computation: the request's computed count goes
back to the first block not loaded and its scheduled tokens grow by as much, so the step computes the
rest of the prompt and samples exactly where the scheduler expects.

Redis loads may be fetched ahead (``prefetch``, when the plan arrives: with async scheduling, while the
step before it runs); ``apply`` then only waits for what is left of the fetch and copies the blocks in.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import torch

from kvgrid.v1 import worker_pb2
from services.common.errors import InvalidArgument
from services.worker.kv_transfer.blocks import CacheBlocks, KvCaches
from services.worker.kv_transfer.host import HostTier
from services.worker.kv_transfer.redis_tier import Loaded, RedisTier
from services.worker.metrics import WorkerMetrics
from services.worker.request_state import RequestState

log = logging.getLogger(__name__)

# Redis blocks being fetched ahead for a plan, by request id (``KvTransfer.prefetch``).
Fetches = dict[str, Future[Loaded]]


class KvTransfer:
    def __init__(
        self,
        kv_caches: KvCaches,
        block_size: int,
        host: HostTier | None = None,
        redis: RedisTier | None = None,
        metrics: WorkerMetrics | None = None,
    ):
        self.kv_caches = kv_caches
        self.cache = CacheBlocks(kv_caches)
        self.block_size = block_size
        self.host = host
        self.redis = redis
        self.metrics = metrics
        k0 = kv_caches[0][0]
        self.bytes_per_block = k0[0].numel() * k0.element_size() * 2 * len(kv_caches)

    @property
    def tier_names(self) -> list[str]:
        return [name for name, tier in (("host", self.host), ("redis", self.redis)) if tier is not None]

    def check(self, plan: worker_pb2.StepPlan) -> None:
        """Raises InvalidArgument for tier moves this worker cannot do (checked before the plan changes anything)."""
        num_blocks = self.kv_caches[0][0].shape[0]
        for where, block in [("kv_saves", save) for save in plan.kv_saves] + [
            ("new_requests.kv_loads", load) for new in plan.new_requests for load in new.kv_loads
        ]:
            tier = block.WhichOneof("tier")
            if block.block_id >= num_blocks:
                raise InvalidArgument(where, f"block id {block.block_id} past the cache ({num_blocks} blocks)")
            if tier == "host_slot" and (self.host is None or block.host_slot >= self.host.num_slots):
                raise InvalidArgument(where, f"host slot {block.host_slot} is not in this worker's host tier")
            if tier != "host_slot" and (self.redis is None or not block.redis_key):
                raise InvalidArgument(where, "a redis key, but this worker serves no redis tier")
        for new in plan.new_requests:
            first = new.num_computed_tokens // self.block_size - len(new.kv_loads)
            loaded = [load.block_id for load in new.kv_loads]
            if new.kv_loads and (first < 0 or list(new.block_ids[first : first + len(loaded)]) != loaded):
                raise InvalidArgument(
                    "new_requests.kv_loads", f"{new.request_id}: loads must fill the blocks before the computed count"
                )

    def prefetch(self, plan: worker_pb2.StepPlan) -> Fetches:
        """Start fetching the plan's Redis loads; they only read Redis, so they may run while an earlier plan's
        step does (its saves to Redis are of blocks no load of this plan asks for: the scheduler only plans
        loads of keys Redis answered for)."""
        if self.redis is None:
            return {}
        fetches: Fetches = {}
        for new in plan.new_requests:
            keys = [load.redis_key for load in _remote(new)]
            if keys:
                fetches[new.request_id] = self.redis.prefetch(keys)
        return fetches

    def apply(self, plan: worker_pb2.StepPlan, scheduled: list[RequestState], fetches: Fetches | None = None) -> int:
        """Saves, then loads (Redis loads from ``fetches`` where ``prefetch`` started them); returns how many
        tokens planned as loads will be computed instead."""
        if plan.kv_saves:
            self._save(plan.kv_saves)
        num_failed = 0
        if any(new.kv_loads for new in plan.new_requests):
            states = {state.request_id: state for state in scheduled}
            for new in plan.new_requests:
                if new.kv_loads:
                    fetched = fetches.get(new.request_id) if fetches else None
                    num_failed += self._load(new, states[new.request_id], fetched)
        return num_failed

    def _save(self, saves) -> None:
        host_blocks, host_slots, redis_blocks, redis_keys = [], [], [], []
        for save in saves:
            if save.WhichOneof("tier") == "host_slot":
                host_blocks.append(save.block_id)
                host_slots.append(save.host_slot)
            else:
                redis_blocks.append(save.block_id)
                redis_keys.append(save.redis_key)
        if host_blocks and self.host is not None:
            self.host.save(host_blocks, host_slots)
            self._count_bytes("saved", "host", len(host_blocks))
        if redis_blocks and self.redis is not None:
            # Copied now (this very step may overwrite the blocks), block by block contiguous as the values hold
            # them; encoded and sent in the background.
            k0 = self.kv_caches[0][0]
            blocks = torch.empty((len(redis_blocks), len(self.kv_caches), 2, *k0.shape[1:]), dtype=k0.dtype)
            self.cache.read_blocks(redis_blocks, blocks)
            if self.redis.save(redis_keys, blocks):
                self._count_bytes("saved", "redis", len(redis_blocks))

    def _load(self, new: worker_pb2.NewRequest, state: RequestState, fetched: Future | None = None) -> int:
        """Fill the request's loaded blocks; on a failure, compute from the first block not loaded."""
        bs = self.block_size
        first = new.num_computed_tokens // bs - len(new.kv_loads)
        loads = list(new.kv_loads)
        remote = _remote(new)
        host = loads[: len(loads) - len(remote)]
        num_loaded = 0
        if host:
            started = time.perf_counter()
            self.host.load([load.host_slot for load in host], [load.block_id for load in host])
            self._observe("host", len(host), time.perf_counter() - started)
            num_loaded = len(host)
        if remote:
            started = time.perf_counter()  # with a prefetch: only the wait for what is left of it, and the copies
            keys = [load.redis_key for load in remote]
            loaded = fetched.result() if fetched is not None else self.redis.load(keys)  # check: a redis tier
            num_blocks = len(loaded.blocks)
            self.cache.write_each([load.block_id for load in remote[:num_blocks]], loaded.blocks, self.redis.map)
            self.redis.release(loaded)
            self._observe("redis", num_blocks, time.perf_counter() - started)
            num_loaded += num_blocks
        if num_loaded == len(loads):
            return 0
        resume = (first + num_loaded) * bs
        num_failed = state.num_computed_tokens - resume
        log.warning(
            "request %s: %d tokens could not be loaded from the KV tiers; computing them", new.request_id, num_failed
        )
        state.num_scheduled_tokens += num_failed
        state.num_computed_tokens = resume
        return num_failed

    def flush(self) -> None:
        """Wait for background saves (tests and benchmarks, before another group reads them)."""
        if self.redis is not None:
            self.redis.flush()

    def _observe(self, tier: str, num_blocks: int, seconds: float) -> None:
        self._count_bytes("loaded", tier, num_blocks)
        if self.metrics is not None:
            self.metrics.kv_tier_load_seconds.labels(model=self.metrics.model, tier=tier).observe(seconds)

    def _count_bytes(self, what: str, tier: str, num_blocks: int) -> None:
        if self.metrics is not None and num_blocks:
            counter = self.metrics.kv_tier_saved_bytes if what == "saved" else self.metrics.kv_tier_loaded_bytes
            counter.labels(model=self.metrics.model, tier=tier).inc(num_blocks * self.bytes_per_block)


def _remote(new: worker_pb2.NewRequest) -> list[worker_pb2.KvTierBlock]:
    """The request's loads from Redis: those after its host loads (host hits come first in the prefix chain and
    cannot fail: the scheduler's slot map is exact)."""
    loads = list(new.kv_loads)
    num_host = next((i for i, load in enumerate(loads) if load.WhichOneof("tier") != "host_slot"), len(loads))
    return loads[num_host:]
