"""The ranks' communicator: torch.distributed (NCCL on CUDA, gloo on CPU) behind the two calls the model needs.

Only the model's all-reduces and one start-up agreement travel over it. Step plans go from rank 0 to
the others over pipes (``ranks.py``): a collective waiting for the next step would hit the process
group's timeout whenever the worker sits idle, and a pipe also tells a rank at once that rank 0 is gone.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from services.common.errors import Unavailable

# Generous: every rank enters each collective within one step, but a first CUDA step may compile kernels.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class RankLost(Unavailable):
    """A collective failed because another rank is gone: the worker is going down (the scheduler re-dials)."""


class DistGroup:
    """This process's rank in the default process group; ``size`` ranks, one device each."""

    def __init__(self, rank: int, size: int, init_addr: str, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{init_addr}", rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns ``x``."""
        try:
            dist.all_reduce(x)
        except RuntimeError as exc:  # gloo: a peer's connection closed; NCCL: an aborted communicator
            raise RankLost(f"a tensor-parallel rank is gone ({str(exc).splitlines()[0]})") from exc
        return x

    def min(self, value: int) -> int:
        """The smallest ``value`` any rank passes (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
