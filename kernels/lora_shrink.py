"""LoRA shrink: each row times the A factor of its own adapter (Punica's BGMV shrink), one launch per projection.

Row t uses ``lora_a[row_slots[t]]``; a negative slot (the base model) gives a zero row. Accumulates in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(
    x_ptr,  # [num_tokens, in_features]
    a_ptr,  # [num_slots, rank_cols, in_features]
    out_ptr,  # [num_tokens, rank_cols] float32
    row_slots_ptr,  # [num_tokens] int32 or int64
    stride_x_t,
    stride_a_s,
    stride_a_r,
    stride_out_t,
    IN_FEATURES: tl.constexpr,
    RANK_COLS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    col_mask = cols < RANK_COLS
    slot = tl.load(row_slots_ptr + token).to(tl.int64)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, IN_FEATURES, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < IN_FEATURES
            x = tl.load(x_ptr + token * stride_x_t + ks, mask=k_mask, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + slot * stride_a_s + cols[:, None] * stride_a_r + ks[None, :],
                mask=col_mask[:, None] & k_mask[None, :],
                other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + token * stride_out_t + cols, acc, mask=col_mask)


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, in_features]
    lora_a: torch.Tensor,  # [num_slots, rank_cols, in_features]
    row_slots: torch.Tensor,  # [num_tokens], -1: no adapter
) -> torch.Tensor:  # [num_tokens, rank_cols] float32
    num_tokens, in_features = x.shape
    rank_cols = lora_a.shape[1]
    assert x.stride(1) == 1 and lora_a.stride(2) == 1, "the input dimension must be contiguous"
    out = torch.empty(num_tokens, rank_cols, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return out
    block_r = min(triton.next_power_of_2(rank_cols), 64)
    grid = (num_tokens, triton.cdiv(rank_cols, block_r))
    lora_shrink_kernel[grid](
        x_ptr=x,
        a_ptr=lora_a,
        out_ptr=out,
        row_slots_ptr=row_slots,
        stride_x_t=x.stride(0),
        stride_a_s=lora_a.stride(0),
        stride_a_r=lora_a.stride(1),
        stride_out_t=out.stride(0),
        IN_FEATURES=in_features,
        RANK_COLS=rank_cols,
        BLOCK_R=block_r,
        BLOCK_K=min(triton.next_power_of_2(in_features), 128),
    )
    return out
