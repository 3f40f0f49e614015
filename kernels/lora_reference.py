"""Slow, obvious torch references of the LoRA kernels, one row at a time, same signatures."""

from __future__ import annotations

import torch


def lora_shrink_reference(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slots, rank_cols, in_features]
    row_slots: torch.Tensor,  # [num_tokens], -1: no adapter
) -> torch.Tensor:  # [num_tokens, rank_cols] float32
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float32, device=x.device)
    for t, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            out[t] = lora_a[slot].float() @ x[t].float()
    return out


def lora_expand_reference(
    shrunk: torch.Tensor,  # [num_tokens, rank_cols] float32
    lora_b: torch.Tensor,  # [num_slots, out_features, rank_cols]
    row_slots: torch.Tensor,  # [num_tokens], -1: no adapter
    out: torch.Tensor,  # [num_tokens, out_features], added to in place
) -> torch.Tensor:
    for t, slot in enumerate(row_slots.tolist()):
        if slot >= 0:
            out[t] = (out[t].float() + lora_b[slot].float() @ shrunk[t]).to(out.dtype)
    return out
