"""Each batch row's adapter applied to the projections: ``out += B[slot] (A[slot] x)`` for rows with an adapter.

``attach_lora`` turns the model's ``Linear`` layers into ``LoraLinear`` ones that share one ``LoraBatch``, the
step's row-to-slot map, set by the runner before each forward. On CUDA the rows go through the Triton shrink and
expand kernels (``kernels/lora_shrink.py``, ``kernels/lora_expand.py``), one launch each per projection; on the CPU
each run of consecutive rows of one adapter is multiplied as one segment, in place: the runner orders a step's
requests by adapter within its decodes and within its prefills, so an adapter has at most two runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.layers.linear import Linear
from services.worker.lora.slots import LoraSlots


class LoraBatch:
    """One step's rows by adapter slot; empty (``active`` False) when no row of the step has an adapter."""

    def __init__(self) -> None:
        self.active = False
        self.row_slots: torch.Tensor | None = None  # [T] int32, -1 for base-model rows (the Triton path)
        self.segments: list[tuple[int, int, int]] = []  # (slot, first row, end row) of each run of one adapter
        self.use_triton = False

    def set(self, row_slots: Sequence[int], device: torch.device) -> None:
        """``row_slots``: each flat-batch row's slot, -1 for the base model."""
        self.segments = runs(row_slots)
        self.active = bool(self.segments)
        self.use_triton = self.active and device.type == "cuda"
        self.row_slots = torch.tensor(row_slots, dtype=torch.int32, device=device) if self.use_triton else None

    def clear(self) -> None:
        self.set([], torch.device("cpu"))


class LoraLinear(Linear):
    """A ``Linear`` whose output gains each row's adapter product (``lora_a``/``lora_b``: this projection's stacks)."""

    lora_a: torch.Tensor  # [max_loras, slices * R, in]
    lora_b: torch.Tensor  # [max_loras, out, slices * R]
    lora_batch: LoraBatch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = Linear.forward(self, x)
        batch = self.lora_batch
        if not batch.active:
            return out
        if batch.use_triton:
            from kernels.lora_expand import lora_expand
            from kernels.lora_shrink import lora_shrink

            return lora_expand(lora_shrink(x, self.lora_a, batch.row_slots), self.lora_b, batch.row_slots, out)
        return add_lora_segments(x, out, self.lora_a, self.lora_b, batch.segments)


def runs(row_slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """(slot, start, end) of each run of consecutive rows of one adapter; base rows (-1) belong to none."""
    segments: list[tuple[int, int, int]] = []
    start = 0
    for row in range(1, len(row_slots) + 1):
        if row == len(row_slots) or row_slots[row] != row_slots[start]:
            if row_slots[start] >= 0:
                segments.append((row_slots[start], start, row))
            start = row
    return segments


def add_lora_segments(
    x: torch.Tensor,  # [T, in]
    out: torch.Tensor,  # [T, out], added to in place
    lora_a: torch.Tensor,  # [max_loras, cols, in]
    lora_b: torch.Tensor,  # [max_loras, out, cols]
    segments: list[tuple[int, int, int]],
) -> torch.Tensor:
    """The torch path: each segment's rows gain ``(x A^T) B^T``, accumulated into ``out`` by one addmm."""
    for slot, start, end in segments:
        rows = out[start:end]
        rows.addmm_(x[start:end] @ lora_a[slot].T, lora_b[slot].T)
    return out


def attach_lora(model: torch.nn.Module, slots: LoraSlots, batch: LoraBatch) -> int:
    """Every projection of ``slots`` on ``model``'s layers becomes a LoraLinear; returns how many."""
    count = 0
    for (layer, proj), (a, b) in slots.stacks.items():
        block = model.layers[layer]
        owner = block.self_attn if proj in ("qkv_proj", "o_proj") else block.mlp
        linear = getattr(owner, proj)
        linear.__class__ = LoraLinear
        linear.lora_a, linear.lora_b, linear.lora_batch = a, b, batch
        count += 1
    return count
