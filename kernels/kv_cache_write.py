"""KV-cache write: scatter the step's new keys and values into their cache slots, one launch per layer.

Slot s lives in block ``s // block_size`` at offset ``s % block_size``. A negative slot marks a
padding token (e.g. a CUDA-graph batch padded to a fixed size) and is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kv_cache_write_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_t,
    stride_key_h,
    stride_value_t,
    stride_value_h,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    # int64 throughout: block * stride_k_block passes 2**31 on large caches.
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [HEADS_PAD, HEAD_PAD]

    key = tl.load(key_ptr + token * stride_key_t + heads[:, None] * stride_key_h + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads[:, None] * stride_value_h + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_k_block + offset * stride_k_slot + heads[:, None] * stride_k_head
    v_dst = v_cache_ptr + block * stride_v_block + offset * stride_v_slot + heads[:, None] * stride_v_head
    tl.store(k_dst + dims[None, :], key, mask=mask)
    tl.store(v_dst + dims[None, :], value, mask=mask)


def kv_cache_write(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = padding token, skipped
) -> None:
    """Write key[t] and value[t] into cache slot ``slot_mapping[t]`` (in place)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or k_cache.shape[2:] != key.shape[1:] or v_cache.shape != k_cache.shape:
        raise ValueError(f"shape mismatch: key {tuple(key.shape)}, cache {tuple(k_cache.shape)}")
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype:
        raise ValueError(f"dtype mismatch: key {key.dtype}, cache {k_cache.dtype}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension of keys, values and caches")
    if num_tokens == 0:
        return
    kv_cache_write_kernel[(num_tokens,)](
        key_ptr=key,
        value_ptr=value,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        slot_mapping_ptr=slot_mapping,
        stride_key_t=key.stride(0),
        stride_key_h=key.stride(1),
        stride_value_t=value.stride(0),
        stride_value_h=value.stride(1),
        stride_k_block=k_cache.stride(0),
        stride_k_slot=k_cache.stride(1),
        stride_k_head=k_cache.stride(2),
        stride_v_block=v_cache.stride(0),
        stride_v_slot=v_cache.stride(1),
        stride_v_head=v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )
