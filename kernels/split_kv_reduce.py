"""Combine split-KV partial attention outputs (flash decoding's second pass).

Split j of a (token, head) saw a subset of the keys and wrote its softmax-normalized output
``o_j`` and ``lse_j = log2(sum_k exp2(s_k))`` over that subset (``-inf`` when it saw none).
The full output is ``sum_j w_j o_j / sum_j w_j`` with ``w_j = exp2(lse_j - max_j lse_j)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def split_kv_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32, contiguous
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, contiguous
    num_heads,
    stride_out_t,
    stride_out_h,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # padded head_dim of the partials (power of two >= HEAD_DIM)
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # next power of two >= NUM_SPLITS
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_PAD)
    row = (token * num_heads + head) * NUM_SPLITS + splits  # [SPLITS_PAD] index into the partials

    lse = tl.load(partial_lse_ptr + row, mask=split_valid, other=float("-inf"))
    # At least one split saw a key (split 0 holds key 0), so the max is finite.
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # [SPLITS_PAD], 0 for splits that saw nothing
    mask = split_valid[:, None] & (dims[None, :] < HEAD_DIM)
    partial = tl.load(partial_out_ptr + row[:, None] * HEAD_PAD + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(weight[:, None] * partial, axis=0) / tl.sum(weight, axis=0)  # [HEAD_PAD]
    out_offsets = token * stride_out_t + head * stride_out_h + dims
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def split_kv_reduce(
    partial_out: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_pad] float32
    partial_lse: torch.Tensor,  # [num_tokens, num_heads, num_splits] float32
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
) -> None:
    num_tokens, num_heads, head_dim = out.shape
    num_splits, head_pad = partial_out.shape[2:]
    if not (partial_out.is_contiguous() and partial_lse.is_contiguous()) or out.stride(-1) != 1:
        raise ValueError("partials must be contiguous and head_dim the contiguous dimension of out")
    if num_tokens == 0:
        return
    split_kv_reduce_kernel[(num_tokens, num_heads)](
        out_ptr=out,
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        num_heads=num_heads,
        stride_out_t=out.stride(0),
        stride_out_h=out.stride(1),
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
