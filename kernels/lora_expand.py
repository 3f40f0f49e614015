"""LoRA expand: each row's shrunk vector times the B factor of its own adapter, added to the base projection's
output in place (Punica's BGMV expand), one launch per projection. Rows with a negative slot are left as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def lora_expand_kernel(
    shrunk_ptr,  # [num_tokens, rank_cols] float32
    b_ptr,  # [num_slots, out_features, rank_cols]
    out_ptr,  # [num_tokens, out_features], added to
    row_slots_ptr,  # [num_tokens] int32 or int64
    stride_shrunk_t,
    stride_b_s,
    stride_b_n,
    stride_out_t,
    OUT_FEATURES: tl.constexpr,
    RANK_COLS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(row_slots_ptr + token).to(tl.int64)
    if slot < 0:
        return
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = ns < OUT_FEATURES
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for r0 in range(0, RANK_COLS, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_mask = rs < RANK_COLS
        s = tl.load(shrunk_ptr + token * stride_shrunk_t + rs, mask=r_mask, other=0.0)
        b = tl.load(
            b_ptr + slot * stride_b_s + ns[:, None] * stride_b_n + rs[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(b * s[None, :], axis=1)
    out_ptrs = out_ptr + token * stride_out_t + ns
    base = tl.load(out_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + acc).to(out_ptr.dtype.element_ty), mask=n_mask)


def lora_expand(
    shrunk: torch.Tensor,  # [num_tokens, rank_cols] float32, from lora_shrink
    lora_b: torch.Tensor,  # [num_slots, out_features, rank_cols]
    row_slots: torch.Tensor,  # [num_tokens], -1: no adapter
    out: torch.Tensor,  # [num_tokens, out_features], added to in place
) -> torch.Tensor:
    num_tokens, rank_cols = shrunk.shape
    out_features = lora_b.shape[1]
    assert out.stride(1) == 1 and lora_b.stride(2) == 1 and shrunk.stride(1) == 1
    if num_tokens == 0:
        return out
    block_n = min(triton.next_power_of_2(out_features), 128)
    grid = (num_tokens, triton.cdiv(out_features, block_n))
    lora_expand_kernel[grid](
        shrunk_ptr=shrunk,
        b_ptr=lora_b,
        out_ptr=out,
        row_slots_ptr=row_slots,
        stride_shrunk_t=shrunk.stride(0),
        stride_b_s=lora_b.stride(0),
        stride_b_n=lora_b.stride(1),
        stride_out_t=out.stride(0),
        OUT_FEATURES=out_features,
        RANK_COLS=rank_cols,
        BLOCK_N=block_n,
        BLOCK_R=min(triton.next_power_of_2(rank_cols), 64),
    )
    return out
