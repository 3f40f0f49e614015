"""Mixture-of-experts feed-forward: top-k routing, then each expert's SiLU-gated MLP over its own tokens.

The experts' weights are two stacked tensors, ``w13`` [X, 2I, E] (each expert's gate rows then up rows) and
``w2`` [X, E, I]. On CPU the experts run as a grouped GEMM in torch: the (token, slot) pairs sorted by expert,
one matrix product per expert over the rows routed to it, the results scaled by the routing weights and added
into their tokens. On CUDA one Triton kernel does the same (``kernels/fused_moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.linear import Linear


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, X] router logits -> (weights [T, k] float32, expert ids [T, k]): softmax in float32, the top k, rescaled
    to sum to 1 when ``renormalize`` (Mixtral always; Qwen3-MoE per ``norm_topk_prob``)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(
    x: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [X, 2I, E]
    w2: torch.Tensor,  # [X, E, I]
    weights: torch.Tensor,  # [T, k] float32
    ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, E]
    """One GEMM per expert over the tokens routed to it (Hugging Face's order of operations per expert)."""
    top_k, inter = ids.shape[1], w2.shape[-1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    tokens = order // top_k
    pair_weights = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        rows = tokens[start : start + count]
        gate, up = F.linear(x.index_select(0, rows), w13[expert]).split(inter, dim=-1)  # [n, I] each
        y = F.linear(F.silu(gate) * up, w2[expert])  # [n, E]
        out.index_add_(0, rows, (y * pair_weights[start : start + count, None]).to(x.dtype))
        start += count
    return out


class SparseMoE(nn.Module):
    """Router ``gate`` [X, E] and the experts' stacked weights; replaces the dense MLP of a layer. Not split by
    tensor parallelism (``parallel/sharding.check_size`` refuses models with experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, renormalize: bool):
        super().__init__()
        self.top_k, self.renormalize, self.intermediate_size = top_k, renormalize, intermediate_size
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        weights, ids = route(self.gate.forward(x), self.top_k, self.renormalize)
        if x.device.type == "cuda":
            from kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, weights, ids)
        return grouped_experts(x, self.w13, self.w2, weights, ids)
