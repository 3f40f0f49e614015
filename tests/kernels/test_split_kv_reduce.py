"""Split-KV reduce kernel vs. its softmax-weighted reference, including splits that saw no key."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import split_kv_reduce_reference
from kernels.split_kv_reduce import split_kv_reduce

from .batches import DEVICE


@pytest.mark.parametrize(("num_splits", "head_dim", "dtype"), [(2, 64, torch.float32), (5, 80, torch.float16)])
def test_matches_reference(num_splits, head_dim, dtype):
    gen = torch.Generator().manual_seed(num_splits)
    head_pad = 128 if head_dim > 64 else 64
    partial_out = torch.randn(6, 3, num_splits, head_pad, generator=gen)
    partial_lse = torch.randn(6, 3, num_splits, generator=gen) * 4
    partial_lse[0, :, 1:] = float("-inf")  # only split 0 saw keys: its output passes through unchanged
    partial_lse[2, 1, 0] = float("-inf")
    expected = torch.empty(6, 3, head_dim, dtype=dtype)
    split_kv_reduce_reference(partial_out, partial_lse, expected)
    torch.testing.assert_close(expected[0].float(), partial_out[0, :, 0, :head_dim], atol=1e-3, rtol=1e-3)

    out = torch.empty(6, 3, head_dim, dtype=dtype, device=DEVICE)
    split_kv_reduce(partial_out.to(DEVICE), partial_lse.to(DEVICE), out)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu(), expected, atol=tol, rtol=tol)
