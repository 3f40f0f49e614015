"""Fused RMSNorm(+residual) kernel vs. the Llama reference. Not wired into the model (speed unmeasured)."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import rms_norm_reference
from kernels.rms_norm import rms_norm

from .batches import DEVICE

# bfloat16 allows two units in the last place: the interpreter rounds float32 -> bfloat16 toward zero
# where CUDA and torch round to nearest even, and the kernel rounds twice (normed, then the product).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 2 * 2**-7}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("hidden", [64, 576])
def test_matches_reference(dtype, with_residual, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden, generator=gen) * 3).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    residual = torch.randn(7, hidden, generator=gen).to(dtype) if with_residual else None
    expected, expected_residual = rms_norm_reference(x, weight, 1e-6, residual)
    out, new_residual = rms_norm(
        x.to(DEVICE), weight.to(DEVICE), 1e-6, None if residual is None else residual.to(DEVICE)
    )
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.cpu().float(), expected.float(), atol=tol, rtol=tol)
    if with_residual:
        residual_tol = 2**-7 if dtype == torch.bfloat16 else 0.0  # one rounding of x + residual
        torch.testing.assert_close(new_residual.cpu(), expected_residual, atol=residual_tol, rtol=residual_tol)
    else:
        assert new_residual is None


def test_reference_matches_hf_llama():
    """The reference itself is Llama's RMSNorm (transformers), so the kernel inherits that meaning."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(32, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = torch.randn(4, 32)
    torch.testing.assert_close(rms_norm_reference(x, norm.weight.detach(), 1e-5)[0], norm(x).detach())
