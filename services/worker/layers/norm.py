"""RMSNorm with the residual add fused in front."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds ``residual`` into ``x`` first when given; returns (normed, the new residual stream).

        ``x`` is overwritten: callers pass the fresh output of a projection."""
        if residual is not None:
            x = x.add_(residual)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps), x
