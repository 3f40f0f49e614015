"""LoRA shrink and expand kernels vs. their one-row-at-a-time references: random slots, base rows, odd widths."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_expand import lora_expand
from kernels.lora_reference import lora_expand_reference, lora_shrink_reference
from kernels.lora_shrink import lora_shrink
from services.worker.lora.apply import add_lora_segments, runs

from .batches import DEVICE


def random_case(num_tokens, num_slots, rank_cols, in_features, out_features, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    lora_a = torch.randn(num_slots, rank_cols, in_features, generator=gen).to(dtype)
    lora_b = torch.randn(num_slots, out_features, rank_cols, generator=gen).to(dtype)
    row_slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, dtype=torch.int32)
    row_slots[0], row_slots[-1] = -1, num_slots - 1  # a base row and the last slot, whatever the draw
    base = torch.randn(num_tokens, out_features, generator=gen).to(dtype)
    return x, lora_a, lora_b, row_slots, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_tokens", "num_slots", "rank_cols", "in_features", "out_features"),
    [(2, 1, 8, 64, 96), (7, 3, 48, 64, 128), (19, 4, 24, 200, 77), (33, 2, 96, 130, 300)],
)
def test_shrink_then_expand_match_references(dtype, num_tokens, num_slots, rank_cols, in_features, out_features):
    x, lora_a, lora_b, row_slots, base = random_case(
        num_tokens, num_slots, rank_cols, in_features, out_features, dtype, seed=num_tokens
    )
    shrunk_ref = lora_shrink_reference(x, lora_a, row_slots)
    expected = lora_expand_reference(shrunk_ref, lora_b, row_slots, base.clone())

    shrunk = lora_shrink(x.to(DEVICE), lora_a.to(DEVICE), row_slots.to(DEVICE))
    torch.testing.assert_close(shrunk.cpu(), shrunk_ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(shrunk.cpu()[0], torch.zeros(rank_cols))  # a base row shrinks to zeros
    out = lora_expand(shrunk_ref.to(DEVICE), lora_b.to(DEVICE), row_slots.to(DEVICE), base.clone().to(DEVICE))
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu(), expected, atol=tol * 10, rtol=tol)
    assert torch.equal(out.cpu()[0], base[0])  # base rows are left as they were
    assert not torch.allclose(expected[-1].float(), base[-1].float())  # the reference really added


def test_torch_segments_match_references():
    """The CPU path (runs of rows of one adapter) computes what the per-row references do."""
    x, lora_a, lora_b, row_slots, base = random_case(23, 3, 16, 40, 56, torch.float32, seed=5)
    row_slots[3:9] = 1  # a longer run among the random ones
    expected = lora_expand_reference(lora_shrink_reference(x, lora_a, row_slots), lora_b, row_slots, base.clone())
    out = add_lora_segments(x, base.clone(), lora_a, lora_b, runs(row_slots.tolist()))
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_runs_of_one_adapter():
    assert runs([-1, 0, 0, 2, 2, -1, -1, 0, 1]) == [(0, 1, 3), (2, 3, 5), (0, 7, 8), (1, 8, 9)]
    assert runs([]) == [] and runs([-1, -1]) == []
