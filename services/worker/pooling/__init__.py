"""Pooling runner (--runner pooling): prompts' final hidden states pooled into one vector each, on the worker."""

from services.worker.pooling.pooler import PooledRow, PoolingState, pool_step

__all__ = ["PooledRow", "PoolingState", "pool_step"]
