"""KV tiers beyond the device pool, the byte-moving half (the scheduler decides: ``services.scheduler.kv_tiers``)."""

from __future__ import annotations

from services.worker.kv_transfer.host import HostTier
from services.worker.kv_transfer.redis_tier import RedisTier
from services.worker.kv_transfer.transfer import KvTransfer

__all__ = ["HostTier", "KvTransfer", "RedisTier"]
