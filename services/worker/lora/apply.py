"""Each batch row's adapter applied to the projections: ``out += B[slot] (A[slot] x)`` for rows with an adapter.

``attach_lora`` turns the model's ``Linear`` layers into ``LoraLinear`` ones that share one ``LoraBatch``, the
step's row-to-slot map, set by the runner before each forward. On CUDA the rows go through the Triton shrink and
expand kernels (``kernels/lora_shrink.py``, ``kernels/lora_expand.py``), one launch each per projection; on the CPU
the rows of each adapter are gathered and multiplied as one group (a step has at most ``max_loras`` groups).
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
        self.groups: list[tuple[int, torch.Tensor | None]] = []  # (slot, row indices or None for every row)
        self.use_triton = False

    def set(self, row_slots: Sequence[int], device: torch.device) -> None:
        """``row_slots``: each flat-batch row's slot, -1 for the base model."""
        slots = sorted(set(row_slots) - {-1})
        self.active = bool(slots)
        if not self.active:
            self.row_slots, self.groups = None, []
            return
        self.use_triton = device.type == "cuda"
        self.row_slots = torch.tensor(row_slots, dtype=torch.int32, device=device)
        if self.use_triton:
            return
        if len(slots) == 1 and -1 not in row_slots:
            self.groups = [(slots[0], None)]
            return
        by_slot: dict[int, list[int]] = {s: [] for s in slots}
        for row, slot in enumerate(row_slots):
            if slot >= 0:
                by_slot[slot].append(row)
        self.groups = [(s, torch.tensor(rows, dtype=torch.int64, device=device)) for s, rows in by_slot.items()]

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
        return add_lora_groups(x, out, self.lora_a, self.lora_b, batch.groups)


def add_lora_groups(
    x: torch.Tensor,  # [T, in]
    out: torch.Tensor,  # [T, out], added to in place
    lora_a: torch.Tensor,  # [max_loras, cols, in]
    lora_b: torch.Tensor,  # [max_loras, out, cols]
    groups: list[tuple[int, torch.Tensor | None]],
) -> torch.Tensor:
    """The torch path: per adapter, its rows' ``(x A^T) B^T`` added to theirs."""
    for slot, rows in groups:
        if rows is None:
            out += (x @ lora_a[slot].T) @ lora_b[slot].T
        else:
            delta = (x.index_select(0, rows) @ lora_a[slot].T) @ lora_b[slot].T
            out.index_add_(0, rows, delta)
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
