"""Paged attention over a flat varlen batch: prefill chunks and decodes in one launch.

Request i owns query rows ``query_start_loc[i] : query_start_loc[i+1]``; they are the last
``q_len_i`` positions of its ``seq_lens[i]`` tokens, whose keys and values are already in the
paged cache (written by ``kv_cache_write`` earlier in the step). Attention is causal within
the new tokens and full over the cached ones.

Split-KV (flash decoding, ``num_splits > 1``): a third grid axis cuts each row block's keys into
``num_splits`` ranges; each writes its normalized partial output and log-sum-exp, and
``split_kv_reduce`` combines them. It gives small batches over long contexts more programs.

One program handles ``BLOCK_Q`` consecutive query tokens of one request and *all* query heads
that share one KV head (grouped-query attention), packed as ``BLOCK_M`` rows
(row = query_token * QUERIES_PER_KV + head_in_group). A decode row block therefore reads each
KV tile once for the whole head group, and ``tl.dot`` gets at least 16 rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .split_kv_reduce import split_kv_reduce

_LOG2E = tl.constexpr(1.4426950408889634)
# Finite stand-in for -inf as the running max: exp2(NEG_BIG - NEG_BIG) is 1, not NaN.
_NEG_BIG = tl.constexpr(-1.0e30)
# The window of a layer that sees every key: longer than any sequence, small enough for int32 positions.
NO_WINDOW = 2**30


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q: tl.constexpr):
    """Largest seq index i with first_tile(i) <= tile_id, first_tile(i) = qsl[i] // BLOCK_Q + i.

    first_tile is increasing and gives request i at least cdiv(q_len_i, BLOCK_Q) tiles, so the
    grid needs num_tokens // BLOCK_Q + num_seqs programs, known on the host without a sync.
    """
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_id:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit(do_not_specialize=["num_seqs"])
def paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    query_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    partial_out_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_PAD] float32, used when NUM_SPLITS > 1
    partial_lse_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32 log2-sum-exp2, used when NUM_SPLITS > 1
    scale,  # float32 softmax scale
    window,  # keys within this many positions of the query (p - window < k <= p); NO_WINDOW for all
    num_seqs,
    stride_out_t,
    stride_out_h,
    stride_q_t,
    stride_q_h,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_partial_t,  # partial_lse's token stride; partial_out's is HEAD_PAD times it
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of two >= HEAD_DIM; lanes past HEAD_DIM are masked
    BLOCK_SIZE: tl.constexpr,  # tokens per KV cache block
    QUERIES_PER_KV: tl.constexpr,  # num_heads // num_kv_heads
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program, power of two >= BLOCK_Q * QUERIES_PER_KV
    TILE_N: tl.constexpr,  # keys per inner iteration; each key looks up its own block, so any power of two >= 16
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no tf32 rounding), else "tf32" (unused for 16-bit)
    DOT_IN_FP32: tl.constexpr,  # upcast dot operands: the interpreter's tl.dot misreads bfloat16 (triton#11584)
    NUM_SPLITS: tl.constexpr,  # 1: write the output directly; more: write partials for split_kv_reduce
):
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_idx = _find_seq(query_start_loc_ptr, num_seqs, tile_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    q_tile_start = (tile_id - (q_start // BLOCK_Q + seq_idx)) * BLOCK_Q  # within the request
    if q_tile_start >= q_len:
        return  # a spare tile of the over-provisioned grid
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    num_cached = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_local = q_tile_start + rows // QUERIES_PER_KV  # query token within the request
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_local < q_len)
    q_pos = num_cached + q_local  # [BLOCK_M] position in the sequence, for the causal mask
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM

    token = (q_start + q_local).to(tl.int64)
    q_offsets = token[:, None] * stride_q_t + head[:, None] * stride_q_h + dims[None, :]
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)  # [BLOCK_M, HEAD_PAD]
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], _NEG_BIG, dtype=tl.float32)  # running max of log2-scaled scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    qk_scale = scale * _LOG2E  # softmax through exp2

    # Keys this tile can see: every cached token plus the new ones up to its last query, from the first key
    # in its first query's window (blocks before it may belong to another request by now: never read).
    num_keys = num_cached + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    first_key = tl.maximum(num_cached + q_tile_start - window + 1, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(num_keys - first_key, TILE_N), NUM_SPLITS)
    key_lo = first_key + split * tiles_per_split * TILE_N
    key_hi = tl.minimum(key_lo + tiles_per_split * TILE_N, num_keys)  # may be <= key_lo: an empty split
    block_table = block_tables_ptr + seq_idx * stride_bt_seq
    cols = tl.arange(0, TILE_N)
    for key_start in range(key_lo, key_hi, TILE_N):
        key_pos = key_start + cols  # [TILE_N]
        key_valid = key_pos < key_hi
        # int64 before the multiply: block_id * stride_k_block passes 2**31 on large caches.
        block_id = tl.load(block_table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = (key_pos % BLOCK_SIZE).to(tl.int64)
        k_mask = dim_valid[:, None] & key_valid[None, :]  # [HEAD_PAD, TILE_N]
        k_offsets = block_id[None, :] * stride_k_block + slot[None, :] * stride_k_slot + kv_head * stride_k_head
        k = tl.load(k_cache_ptr + k_offsets + dims[:, None], mask=k_mask, other=0.0)  # [HEAD_PAD, TILE_N]
        v_offsets = block_id[:, None] * stride_v_block + slot[:, None] * stride_v_slot + kv_head * stride_v_head
        v_mask = key_valid[:, None] & dim_valid[None, :]
        v = tl.load(v_cache_ptr + v_offsets + dims[None, :], mask=v_mask, other=0.0)  # [TILE_N, HEAD_PAD]
        if DOT_IN_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
        causal = (key_pos[None, :] <= q_pos[:, None]) & (key_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(causal & key_valid[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_M, TILE_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if NUM_SPLITS == 1:
        # Every valid row saw its own key, so l_i > 0 there.
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]
        out_offsets = token[:, None] * stride_out_t + head[:, None] * stride_out_h + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # A split may hold no key a row can see (empty, or past its causal limit): weight 0 in the reduce.
        # Some split holds each valid row's own key, so every valid row has at least one finite lse.
        seen = l_i > 0
        partial = acc / tl.where(seen, l_i, 1.0)[:, None]  # [BLOCK_M, HEAD_PAD]
        lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))  # [BLOCK_M]
        lse_offsets = token * stride_partial_t + head * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_lse_ptr + lse_offsets, lse, mask=row_valid)
        partial_offsets = lse_offsets[:, None] * HEAD_PAD + dims[None, :]
        tl.store(partial_out_ptr + partial_offsets, partial, mask=row_valid[:, None])


def _rows_per_program(queries_per_kv: int, max_query_len: int) -> int:
    """16 rows (tl.dot's minimum) for decode-only steps, wider tiles when prefill chunks are present."""
    base = 16 if max_query_len <= 1 else 64
    return max(base, triton.next_power_of_2(queries_per_kv))


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    tile_n: int = 32,
    num_splits: int = 1,
    window: int = 0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Attention of each new token over its request's cached and new keys (already in the cache); with
    ``window`` > 0 over the keys of the last ``window`` positions only (sliding-window layers).

    ``tile_n`` (keys per iteration) and ``num_splits`` (split-KV ranges) change speed, not results."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit query head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if not (query.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"dtype mismatch: query {query.dtype}, cache {k_cache.dtype}/{v_cache.dtype}")
    if query.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("head_dim must be the contiguous dimension of query and caches")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out

    # The interpreter's tl.dot multiplies bfloat16 bit patterns; native CUDA keeps bfloat16 tensor-core dots.
    dot_in_fp32 = query.dtype == torch.bfloat16 and isinstance(paged_attention_kernel, InterpretedFunction)
    queries_per_kv = num_heads // num_kv_heads
    block_m = _rows_per_program(queries_per_kv, max_query_len)
    block_q = block_m // queries_per_kv
    head_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        partial_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
        partial_out = torch.empty(num_tokens, num_heads, num_splits, head_pad, dtype=torch.float32, device=query.device)
    else:
        partial_lse = partial_out = out  # never touched
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    paged_attention_kernel[grid](
        out_ptr=out,
        query_ptr=query,
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        block_tables_ptr=block_tables,
        query_start_loc_ptr=query_start_loc,
        seq_lens_ptr=seq_lens,
        partial_out_ptr=partial_out,
        partial_lse_ptr=partial_lse,
        scale=float(scale),
        window=window if window > 0 else NO_WINDOW,
        num_seqs=num_seqs,
        stride_out_t=out.stride(0),
        stride_out_h=out.stride(1),
        stride_q_t=query.stride(0),
        stride_q_h=query.stride(1),
        stride_k_block=k_cache.stride(0),
        stride_k_slot=k_cache.stride(1),
        stride_k_head=k_cache.stride(2),
        stride_v_block=v_cache.stride(0),
        stride_v_slot=v_cache.stride(1),
        stride_v_head=v_cache.stride(2),
        stride_bt_seq=block_tables.stride(0),
        stride_partial_t=num_heads * num_splits,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or dot_in_fp32 else "tf32",
        DOT_IN_FP32=dot_in_fp32,
        NUM_SPLITS=num_splits,
    )
    if num_splits > 1:
        split_kv_reduce(partial_out, partial_lse, out)
    return out
