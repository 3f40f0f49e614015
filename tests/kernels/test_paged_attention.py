"""Paged attention kernel vs. the gather-through-the-block-table reference.

On machines without CUDA these run in the Triton interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before triton is imported; test_interpreter_is_active checks that it held), so the
shapes stay small: a few heads, contexts under 64 tokens. Large shapes are ``cuda``-marked.
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import paged_attention, paged_attention_kernel
from kernels.reference import paged_attention_reference

from .batches import DECODES, DEVICE, MIXED, random_batch

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _check(batch, dtype: torch.dtype, num_splits: int = 1) -> None:
    scale = batch.query.shape[-1] ** -0.5
    out = paged_attention(*batch.args(), scale, batch.max_query_len, num_splits=num_splits)
    expected = paged_attention_reference(*batch.args(), scale, batch.max_query_len)
    assert out.dtype == dtype and out.shape == batch.query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_interpreter_is_active():
    """Without CUDA the kernels must have been built for the interpreter, else nothing below could run."""
    if torch.cuda.is_available():
        pytest.skip("native CUDA kernels")
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(paged_attention_kernel, InterpretedFunction)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (3, 1), (8, 1)])
def test_mixed_prefill_and_decode_float32(num_heads, num_kv_heads, head_dim, block_size):
    batch = random_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed=head_dim)
    _check(batch, torch.float32)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (3, 1), (8, 1), (6, 2)])
def test_decode_only_float32(num_heads, num_kv_heads):
    batch = random_batch(DECODES, num_heads, num_kv_heads, 64, 16, torch.float32, seed=num_heads)
    assert batch.max_query_len == 1  # the 16-row decode tiling
    _check(batch, torch.float32)


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (torch.float16, 3, 1, 64, 16),
        (torch.float16, 8, 1, 128, 32),
        (torch.bfloat16, 3, 1, 64, 32),
        (torch.bfloat16, 2, 2, 128, 16),
    ],
)
def test_half_precision(dtype, num_heads, num_kv_heads, head_dim, block_size):
    batch = random_batch(MIXED, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=7)
    _check(batch, dtype)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_non_power_of_two_head_dim(head_dim):
    """Padded to the next power of two with masked lanes; the padding must not leak into the output."""
    batch = random_batch(MIXED, 3, 1, head_dim, 16, torch.float32, seed=head_dim)
    _check(batch, torch.float32)


@pytest.mark.parametrize(
    ("lens", "num_splits", "dtype"),
    [(MIXED, 2, torch.float32), (MIXED, 3, torch.float32), (DECODES, 4, torch.float16), ([(1, 200)], 8, torch.float32)],
)
def test_split_kv(lens, num_splits, dtype):
    """Flash-decoding splits: prefill rows whose causal limit ends before a split, and empty splits
    (more splits than key tiles), must carry no weight in the reduce."""
    batch = random_batch(lens, 3, 1, 64, 16, dtype, seed=num_splits)
    _check(batch, dtype, num_splits=num_splits)


@pytest.mark.parametrize(("window", "num_splits"), [(1, 1), (5, 1), (16, 1), (21, 2), (40, 3)])
def test_sliding_window(window, num_splits):
    """A sliding-window layer (keys p - window < k <= p): prefill chunks whose window starts mid-block and decodes;
    the blocks wholly before each request's first window hold NaN (freed, perhaps reused) and are never read."""
    batch = random_batch(MIXED, 3, 1, 64, 16, torch.float32, seed=window)
    starts = batch.query_start_loc.tolist()
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        first_key = max(seq_len - (starts[i + 1] - starts[i]) - window + 1, 0)
        for block in batch.block_tables[i, : first_key // 16].tolist():
            batch.k_cache[block], batch.v_cache[block] = float("nan"), float("nan")
    scale = 0.125
    out = paged_attention(*batch.args(), scale, batch.max_query_len, num_splits=num_splits, window=window)
    clean = [t.nan_to_num(0.0) for t in (batch.k_cache, batch.v_cache)]  # the reference gathers whole tables
    args = (batch.query, *clean, *batch.args()[3:])
    expected = paged_attention_reference(*args, scale, batch.max_query_len, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    full = paged_attention_reference(*args, scale, batch.max_query_len)
    assert not torch.allclose(expected, full)  # the window changed the result


def test_causal_within_new_tokens():
    """Changing a later new token's key/value must not change earlier rows of the same chunk."""
    batch = random_batch([(9, 20)], 2, 1, 64, 16, torch.float32, seed=3)
    before = paged_attention(*batch.args(), 0.125, batch.max_query_len)
    last_block, last_slot = batch.block_tables[0, 19 // 16], 19 % 16
    batch.k_cache[last_block, last_slot] += 5.0
    batch.v_cache[last_block, last_slot] -= 5.0
    after = paged_attention(*batch.args(), 0.125, batch.max_query_len)
    torch.testing.assert_close(after[:-1], before[:-1], atol=0, rtol=0)
    assert not torch.allclose(after[-1], before[-1])


def test_strided_query_and_out_buffer():
    """A query sliced from a fused QKV projection (non-contiguous rows) and a caller-provided output."""
    batch = random_batch(MIXED, 3, 1, 64, 16, torch.float32, seed=11)
    num_tokens = batch.query.shape[0]
    qkv = torch.randn(num_tokens, 5, 64, device=DEVICE)  # 3 query heads, then 1 key head, 1 value head
    qkv[:, :3] = batch.query
    query = qkv[:, :3]
    assert not query.is_contiguous()
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(query, *batch.args()[1:], 0.125, batch.max_query_len, out=out)
    assert result is out
    expected = paged_attention_reference(*batch.args(), 0.125, batch.max_query_len)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_block_offsets_past_int32():
    """block_id * block_size * num_kv_heads * head_dim > 2**31 needs int64 offsets in the kernel.

    The cache is a real [2**21 + 4, 16, 1, 64] float16 tensor pair (4 GiB each) from torch.empty:
    the OS commits its pages only when touched, and this test touches three blocks of each, so
    resident memory stays at a few hundred KiB. A 2**31-element view over a small buffer is not
    possible (torch checks a view's extent against its storage), and faking strides would not
    reach the addresses the kernel really computes. With int32 offsets the kernel reads from
    wrapped (invalid) addresses: garbage or a crash, either way a failure here.
    """
    block_size, head_dim, num_blocks = 16, 64, 2**21 + 4
    assert (num_blocks - 1) * block_size * head_dim > 2**31
    try:
        k_cache = torch.empty(num_blocks, block_size, 1, head_dim, dtype=torch.float16, device=DEVICE)
        v_cache = torch.empty_like(k_cache)
    except (RuntimeError, MemoryError) as exc:  # a host without overcommit
        pytest.skip(f"cannot reserve the address space: {exc}")
    blocks = torch.tensor([[num_blocks - 1, 3, num_blocks - 2]], dtype=torch.int32, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    k_cache[blocks[0].long()] = torch.randn(3, block_size, 1, head_dim, generator=gen).to(DEVICE, torch.float16)
    v_cache[blocks[0].long()] = torch.randn(3, block_size, 1, head_dim, generator=gen).to(DEVICE, torch.float16)
    query = torch.randn(6, 2, head_dim, generator=gen).to(DEVICE, torch.float16)
    query_start_loc = torch.tensor([0, 6], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([41], dtype=torch.int32, device=DEVICE)
    args = (query, k_cache, v_cache, blocks, query_start_loc, seq_lens)
    out = paged_attention(*args, 0.125, 6)
    expected = paged_attention_reference(*args, 0.125, 6)
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (9, 3, 64), (32, 32, 128)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_large_shapes_cuda(dtype, num_heads, num_kv_heads, head_dim, num_splits):
    lens = [(1, 2048)] * 24 + [(512, 1800), (300, 300), (1, 4000), (77, 2100)]
    batch = random_batch(lens, num_heads, num_kv_heads, head_dim, 16, dtype, seed=1)
    _check(batch, dtype, num_splits=num_splits)
