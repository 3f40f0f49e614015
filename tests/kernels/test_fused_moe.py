"""The fused mixture-of-experts kernel (grouped GEMMs over the tokens routed to each expert) vs. the token-by-token
reference; on machines without CUDA through the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from kernels.fused_moe import align_by_expert, fused_moe
from kernels.reference import fused_moe_reference
from services.worker.layers.moe import grouped_experts, route

from .batches import DEVICE

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _case(num_tokens, hidden, inter, num_experts, top_k, dtype, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=g)
    if skew:  # most tokens to expert 0, none to the last expert
        logits[:, 0] += 4.0
        logits[:, -1] -= 100.0
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    to = lambda t: t.to(DEVICE, dtype)  # noqa: E731
    return to(x), to(w13), to(w2), weights.to(DEVICE), ids.to(DEVICE)


def test_align_by_expert_groups_pairs_and_pads_each_run():
    ids = torch.tensor([[2, 0], [0, 1], [2, 0]])  # pairs 0..5
    sorted_ids, experts = align_by_expert(ids, num_experts=4, block_m=4)
    assert experts.tolist() == [0, 1, 2]
    assert sorted_ids.tolist() == [1, 2, 5, 6, 3, 6, 6, 6, 0, 4, 6, 6]


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "num_experts", "top_k"),
    [(1, 64, 32, 4, 2), (7, 64, 96, 8, 2), (33, 80, 48, 6, 3), (20, 32, 16, 3, 1)],
)
def test_fused_moe_equals_reference_float32(num_tokens, hidden, inter, num_experts, top_k):
    x, w13, w2, weights, ids = _case(num_tokens, hidden, inter, num_experts, top_k, torch.float32, seed=num_tokens)
    out = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_experts_with_many_tokens_and_experts_with_none():
    x, w13, w2, weights, ids = _case(40, 64, 32, 5, 2, torch.float32, seed=3, skew=True)
    assert (ids == 0).sum() > 16 and not (ids == 4).any()  # several blocks for one expert, none for another
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), fused_moe_reference(x, w13, w2, weights, ids))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    x, w13, w2, weights, ids = _case(9, 64, 32, 4, 2, dtype, seed=5)
    out = fused_moe(x, w13, w2, weights, ids)
    expected = fused_moe_reference(x, w13, w2, weights, ids)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected.float(), atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_cpu_grouped_gemm_equals_reference():
    """The worker's CPU path (one GEMM per expert over its tokens) computes what the kernel computes."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(25, 48, generator=g)
    w13 = torch.randn(5, 64, 48, generator=g) / 7
    w2 = torch.randn(5, 48, 32, generator=g) / 6
    weights, ids = route(torch.randn(25, 5, generator=g), 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(25))
    out = grouped_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, fused_moe_reference(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
