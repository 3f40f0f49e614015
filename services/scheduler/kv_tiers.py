"""KV tiers beyond the device pool, the deciding half: which blocks to save where, and what to load back.

The worker moves the bytes (``services.worker.kv_transfer``); this module only picks block ids, host
slots and Redis keys and puts them in the step plan:

- save: a cached block evicted from the device pool is copied to a host slot; every full block of a
  finishing request is written through to Redis once per key. Saves ride in the plan that may reuse the
  block and the worker runs them before that plan's loads and forward pass, so a block is never
  overwritten before its save copied it (plans run in order, so a plan still in flight wrote its
  blocks before a later plan's saves read them).
- load: at admission, past the device prefix hit, the host index then Redis are asked (side-effect free)
  how many more whole blocks of the prompt they hold; the scheduler allocates device blocks for them and
  counts them computed. A load the worker cannot do is computed instead (it reports how many tokens).

Host slots loaded in a plan are pinned for the rest of that plan's scheduling: saves are applied before
loads on the worker, so a slot taken by a later save in the same plan would be read overwritten.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvgrid.v1 import scheduler_pb2, worker_pb2
from services.common import kv_keys
from services.common.config import Config
from services.scheduler.free_queue import KVCacheBlock
from services.scheduler.prefix_hash import BlockHash
from services.scheduler.request import Request

log = logging.getLogger(__name__)

# After a failed Redis lookup, admissions skip Redis for this long (a dead server must not slow every step).
REDIS_RETRY_S = 2.0
# Keys this scheduler knows to be in Redis (written or seen); a bounded LRU, only used to skip repeat writes.
MAX_KNOWN_KEYS = 1 << 20
MAX_PROBES = 4096


@dataclass(slots=True)
class TierBlock:
    """One block moving between the device pool and a tier: ``host_slot`` >= 0, or a ``redis_key``."""

    block_id: int
    host_slot: int = -1
    redis_key: str = ""

    @property
    def tier(self) -> str:
        return "host" if self.host_slot >= 0 else "redis"


@dataclass(slots=True)
class TierCounters:
    lookup_tokens: int = 0
    hit_tokens: int = 0
    saved_bytes: int = 0
    loaded_bytes: int = 0
    failed_tokens: int = 0
    lookup_failures: int = 0


class HostIndex:
    """Which prefix blocks the worker's host tier holds: ``num_slots`` slots, least recently used evicted first."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        # hash value -> (hash, slot); least recently used first.
        self._entries: OrderedDict[int, tuple[BlockHash, int]] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, block_hash: BlockHash) -> int | None:
        """The slot holding exactly this block (verified like a device hit), without touching the LRU order."""
        entry = self._entries.get(block_hash.value)
        if entry is None or entry[0] != block_hash:
            return None
        return entry[1]

    def pin(self, block_hash: BlockHash) -> None:
        """Loaded in the plan being built: most recently used, and not reused until the next plan."""
        self._entries.move_to_end(block_hash.value)
        self._pinned.add(self._entries[block_hash.value][1])

    def put(self, block_hash: BlockHash) -> int | None:
        """A slot to save this block into, evicting the least recently used unpinned one; None when the
        block is held already or every slot is pinned."""
        if block_hash.value in self._entries:
            self._entries.move_to_end(block_hash.value)
            return None
        slot = self._free.pop() if self._free else self._evict()
        if slot is not None:
            self._entries[block_hash.value] = (block_hash, slot)
        return slot

    def begin_plan(self) -> None:
        self._pinned.clear()

    def _evict(self) -> int | None:
        for value, (_, slot) in self._entries.items():
            if slot not in self._pinned:
                del self._entries[value]
                return slot
        return None


class RedisIndex:
    """Side-effect-free lookups in the shared Redis tier (EXISTS in one pipeline) and a memory of written keys."""

    def __init__(self, client: Any):
        self.client = client
        self._known: OrderedDict[str, None] = OrderedDict()
        self._retry_at = 0.0

    def count_present(self, keys: list[str]) -> int | None:
        """How many leading ``keys`` Redis holds; None when asking failed (then Redis is left alone a while: 0)."""
        if not keys or time.monotonic() < self._retry_at:
            return 0
        try:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            present = pipe.execute()
        except Exception as exc:  # noqa: BLE001 - any client or connection error means "not available now"
            self._retry_at = time.monotonic() + REDIS_RETRY_S
            log.warning("redis KV tier lookup failed (%s: %s); recomputing", type(exc).__name__, exc)
            return None
        num = 0
        for key, found in zip(keys, present, strict=True):
            if not found:
                self._known.pop(key, None)  # evicted or never stored: write it again next time
                break
            self.remember(key)
            num += 1
        return num

    def forget(self, key: str) -> None:
        self._known.pop(key, None)

    def is_known(self, key: str) -> bool:
        return key in self._known

    def remember(self, key: str) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > MAX_KNOWN_KEYS:
            self._known.popitem(last=False)


@dataclass(slots=True)
class KvTiers:
    """The scheduler's view of the tiers; plain values in (construction never dials anything)."""

    block_size: int
    bytes_per_block: int
    namespace: str
    host: HostIndex | None = None
    redis: RedisIndex | None = None
    counters: dict[str, TierCounters] = field(default_factory=dict)
    metrics: Any = None  # SchedulerMetrics (the kvgrid_kv_tier_* counters), or None
    _saves: list[TierBlock] = field(default_factory=list)
    # Redis answers for requests not admitted yet: (request id, id(request), first block, end block) -> count.
    _probed: dict[tuple, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.names:
            self.counters[name] = TierCounters()

    @property
    def names(self) -> list[str]:
        return [name for name, tier in (("host", self.host), ("redis", self.redis)) if tier is not None]

    def has_saves(self) -> bool:
        return bool(self._saves)

    def begin_plan(self) -> None:
        if self.host is not None:
            self.host.begin_plan()

    def take_saves(self) -> list[TierBlock]:
        saves, self._saves = self._saves, []
        return saves

    def lookup(self, request: Request, num_device_blocks: int) -> list[TierBlock]:
        """Blocks of the prompt right after the device hit that the tiers hold (``block_id`` unset: -1).

        Never the last token's block span: like a device hit, the last token is always computed; and nothing for a
        request that computes every token (``skip_prefix_cache``)."""
        if request.skip_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        loads: list[TierBlock] = []
        i = num_device_blocks
        if self.host is not None:
            while i < min(max_blocks, len(hashes)):
                slot = self.host.find(hashes[i])
                if slot is None:
                    break
                loads.append(TierBlock(-1, host_slot=slot))
                i += 1
        if self.redis is not None and i < max_blocks:
            keys = self.keys(request, max_blocks)[i:max_blocks]
            # A request that waits for blocks is looked up at every step: Redis is asked once per wait.
            probe = (request.request_id, id(request), i, max_blocks)
            num = self._probed.get(probe)
            if num is None:
                num = self.redis.count_present(keys)
                if num is None:
                    self._count("redis", lookup_failures=1)
                    num = 0
                if len(self._probed) > MAX_PROBES:
                    self._probed.clear()
                self._probed[probe] = num
            loads += [TierBlock(-1, redis_key=key) for key in keys[:num]]
        return loads

    def pin(self, request: Request, num_device_blocks: int, loads: list[TierBlock]) -> None:
        """Keep the host slots of ``loads`` from being reused by saves while this plan is built."""
        for i, load in enumerate(loads):
            if load.host_slot >= 0:
                self.host.pin(request.block_hashes[num_device_blocks + i])

    def commit(self, request: Request, loads: list[TierBlock], block_ids: list[int], num_device_blocks: int) -> None:
        """The request was admitted with ``loads``: give them their device blocks and count the lookup."""
        self._probed.clear()
        if request.skip_prefix_cache:
            return  # no lookup was made
        for load, block_id in zip(loads, block_ids[num_device_blocks:], strict=False):
            load.block_id = block_id
        max_blocks = (request.num_tokens - 1) // self.block_size
        remaining = max(max_blocks - num_device_blocks, 0) * self.block_size
        for name in self.names:
            num_blocks = sum(1 for load in loads if load.tier == name)
            hits = num_blocks * self.block_size
            self._count(
                name,
                lookup_tokens=remaining,
                hit_tokens=hits,
                loaded_bytes=num_blocks * self.bytes_per_block,
            )
            remaining -= hits

    def on_evict(self, block: KVCacheBlock) -> None:
        """A cached block is handed out again (``BlockPool.on_evict``): copy it to the host tier first."""
        if self.host is None:
            return
        slot = self.host.put(block.block_hash)
        if slot is not None:
            self._saves.append(TierBlock(block.block_id, host_slot=slot))
            self._count("host", saved_bytes=self.bytes_per_block)

    def on_release(self, request: Request, table: list[KVCacheBlock]) -> None:
        """The request finished or was aborted, ``table`` its blocks: write its computed full blocks through to
        Redis (those not known to be there)."""
        if self.redis is None or not table:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens, len(table) * self.block_size)
        keys = self.keys(request, num_full // self.block_size)
        for block, key in zip(table, keys, strict=False):
            if not self.redis.is_known(key):
                self.redis.remember(key)
                self._saves.append(TierBlock(block.block_id, redis_key=key))
                self._count("redis", saved_bytes=self.bytes_per_block)

    def record_failed_loads(self, num_tokens: int, loads: Iterable[TierBlock]) -> None:
        """The worker computed ``num_tokens`` of the plan's ``loads`` instead: their keys are no longer trusted to be
        in Redis (the worker drops values it rejects), so they are written again when their requests finish."""
        if not num_tokens:
            return
        log.warning("%d tokens planned as KV tier loads were recomputed", num_tokens)
        self._count("redis", failed_tokens=num_tokens)
        if self.redis is not None:
            for load in loads:
                self.redis.forget(load.redis_key)

    def keys(self, request: Request, num_blocks: int) -> list[str]:
        # The adapter is part of what shapes a block's bytes: its own namespace (as its own prefix-hash seed).
        namespace = f"{self.namespace}|lora={request.lora_name}" if request.lora_name else self.namespace
        return kv_keys.extend_keys(
            request.tier_keys, namespace, request.all_token_ids, self.block_size, num_blocks, request.mm_spans
        )

    def stats(self) -> list[scheduler_pb2.KvTierStats]:
        """Each tier's counters, for GetStats."""
        return [
            scheduler_pb2.KvTierStats(
                tier=name,
                lookup_tokens=c.lookup_tokens,
                hit_tokens=c.hit_tokens,
                saved_bytes=c.saved_bytes,
                loaded_bytes=c.loaded_bytes,
                failed_tokens=c.failed_tokens,
                lookup_failures=c.lookup_failures,
            )
            for name, c in self.counters.items()
        ]

    def _count(self, tier: str, **amounts: int) -> None:
        counters = self.counters.get(tier)
        if counters is None:
            return
        for name, amount in amounts.items():
            setattr(counters, name, getattr(counters, name) + amount)
            if self.metrics is not None and amount:
                self.metrics.kv_tier(name).labels(model=self.metrics.model, tier=tier).inc(amount)


def build_tiers(info: worker_pb2.HandshakeResponse, config: Config, metrics=None) -> KvTiers | None:
    """The KV tiers both this scheduler (--kv-tiers) and the worker (its handshake) use; None when there are none."""
    names = [name for name in config.cache.kv_tier_names if name in info.kv_tiers]
    for name in set(config.cache.kv_tier_names) - set(names):
        log.warning("--kv-tiers %s: the worker does not serve that tier; it stays off", name)
    host = HostIndex(info.num_host_blocks) if "host" in names and info.num_host_blocks else None
    redis_index = None
    if "redis" in names:
        import redis

        client = redis.Redis.from_url(config.cache.kv_redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        redis_index = RedisIndex(client)
    if host is None and redis_index is None:
        return None
    ns = kv_keys.namespace(info.model, info.dtype, info.block_size, info.bytes_per_block)
    return KvTiers(info.block_size, info.bytes_per_block, ns, host, redis_index, metrics=metrics)
