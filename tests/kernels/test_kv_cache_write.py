"""KV-cache write kernel vs. the one-slot-at-a-time reference."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache_write import kv_cache_write
from kernels.reference import kv_cache_write_reference

from .batches import DEVICE


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "block_size"), [(1, 64, 16), (3, 128, 32), (2, 80, 16)])
def test_scatter_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 6, 23
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slot_mapping[[4, 17]] = -1  # padding tokens: skipped
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    kv_cache_write_reference(key, value, expected_k, expected_v, slot_mapping)

    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    kv_cache_write(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slot_mapping.to(DEVICE))
    assert torch.equal(k_cache.cpu(), expected_k)
    assert torch.equal(v_cache.cpu(), expected_v)
    block, offset = divmod(int(slot_mapping[0]), block_size)
    assert torch.equal(k_cache[block, offset].cpu(), key[0])  # the reference really wrote


def test_strided_key_value_from_fused_qkv():
    """Keys and values sliced from a fused QKV projection are not contiguous over tokens."""
    qkv = torch.randn(9, 3 + 1 + 1, 64, device=DEVICE)
    key, value = qkv[:, 3:4], qkv[:, 4:5]
    k_cache, v_cache = torch.zeros(2, 16, 1, 64, device=DEVICE), torch.zeros(2, 16, 1, 64, device=DEVICE)
    slot_mapping = torch.arange(20, 29, device=DEVICE)
    kv_cache_write(key, value, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.view(-1, 1, 64)[20:29], key)
    assert torch.equal(v_cache.view(-1, 1, 64)[20:29], value)
    assert not k_cache.view(-1, 1, 64)[:20].any()


def test_slots_past_int32():
    """Slot * (num_kv_heads * head_dim) > 2**31: int64 offsets (see test_block_offsets_past_int32 for the trick)."""
    block_size, head_dim, num_blocks = 16, 64, 2**21 + 4
    try:
        k_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16, device=DEVICE)
        v_cache = torch.empty_like(k_cache)
    except (RuntimeError, MemoryError) as exc:
        pytest.skip(f"cannot reserve the address space: {exc}")
    slot_mapping = torch.tensor([(num_blocks - 1) * block_size + 5, (num_blocks - 2) * block_size, 7])
    key = torch.randn(3, 1, head_dim).half()
    value = torch.randn(3, 1, head_dim).half()
    kv_cache_write(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slot_mapping.to(DEVICE))
    for t, slot in enumerate(slot_mapping.tolist()):
        assert torch.equal(k_cache[slot // block_size, slot % block_size].cpu(), key[t])
        assert torch.equal(v_cache[slot // block_size, slot % block_size].cpu(), value[t])
