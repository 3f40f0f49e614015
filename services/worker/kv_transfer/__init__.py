"""KV tiers beyond the device pool, the byte-moving half (the scheduler decides: ``services.scheduler.kv_tiers``)."""

from __future__ import annotations

from .host import HostTier
from .redis_tier import RedisTier
from .transfer import KvTransfer

__all__ = ["HostTier", "KvTransfer", "RedisTier"]
