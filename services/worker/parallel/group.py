"""The ranks' communicator: torch.distributed (NCCL on CUDA, gloo on CPU) behind the calls the model needs.

Rank r sits in pipeline stage r // T at tensor-parallel position r % T (T = --tensor-parallel-size). The
all-reduces of a stage's T ranks use that stage's group; activations pass between stages point-to-point,
from each rank to the rank at its position in the next stage. Step plans do not travel here but over the
control channel (``control.py``): a collective waiting for the next step would hit the process group's
timeout whenever the worker sits idle, and a closed socket also tells a rank at once that rank 0 is gone.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from services.common.errors import Unavailable

# Generous: every rank enters each collective within one step, but a first CUDA step may compile kernels.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


class RankLost(Unavailable):
    """A collective failed because another rank is gone: the worker is going down (the scheduler re-dials)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where rank ``rank`` sits among ``tp`` x ``pp`` ranks."""

    rank: int
    tp: int = 1
    pp: int = 1

    @property
    def size(self) -> int:
        return self.tp * self.pp

    @property
    def stage(self) -> int:
        return self.rank // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    @property
    def prev_rank(self) -> int:
        return self.rank - self.tp

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp


class DistGroup:
    """This process's rank in the default process group, joined through rank 0's store."""

    def __init__(self, layout: Layout, store: dist.Store, device: torch.device):
        self.layout, self.device = layout, device
        self.rank, self.size = layout.rank, layout.size
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, store=store, rank=layout.rank, world_size=layout.size, timeout=COLLECTIVE_TIMEOUT
        )
        self.stage_group = None  # the default group when there is one stage
        if layout.pp > 1 and layout.tp > 1:
            for stage in range(layout.pp):  # every rank creates every group, in the same order
                group = dist.new_group(list(range(stage * layout.tp, (stage + 1) * layout.tp)))
                if stage == layout.stage:
                    self.stage_group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over this stage's tensor-parallel ranks, in place; returns ``x``."""
        try:
            dist.all_reduce(x, group=self.stage_group)
        except RuntimeError as exc:  # gloo: a peer's connection closed; NCCL: an aborted communicator
            raise RankLost(f"a tensor-parallel rank is gone ({str(exc).splitlines()[0]})") from exc
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        try:
            dist.send(x.contiguous(), dst)
        except RuntimeError as exc:
            raise RankLost(f"pipeline rank {dst} is gone ({str(exc).splitlines()[0]})") from exc

    def isend(self, x: torch.Tensor, dst: int) -> dist.Work:
        """Starts sending ``x`` (kept alive by the caller until the returned work completes)."""
        try:
            return dist.isend(x, dst)
        except RuntimeError as exc:
            raise RankLost(f"pipeline rank {dst} is gone ({str(exc).splitlines()[0]})") from exc

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, src: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=dtype, device=self.device)
        try:
            dist.recv(x, src)
        except RuntimeError as exc:
            raise RankLost(f"pipeline rank {src} is gone ({str(exc).splitlines()[0]})") from exc
        return x

    def min(self, value: int) -> int:
        """The smallest ``value`` any rank passes (every rank must call it)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
