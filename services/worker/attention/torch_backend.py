"""Attention in plain torch over the paged cache, for CPU and CUDA.

Decodes (one new token) are batched: the leading run of decode requests gathers its
blocks in one indexing op and runs one SDPA call with a length mask, the query heads of
each KV group standing in for the query length. Requests with several new tokens (prefill
chunks) run one SDPA call each over their own blocks; there are few of them per step.
The runner puts decodes first, so a mixed step takes the batched path for all its decodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_decodes = _leading_decodes(meta.query_lens_cpu)
        if num_decodes == meta.num_seqs:
            return _decode(query, k_cache, v_cache, meta, scale, num_decodes)
        out = torch.empty_like(query)
        if num_decodes:
            out[:num_decodes] = _decode(query[:num_decodes], k_cache, v_cache, meta, scale, num_decodes)
        block_size = k_cache.shape[1]
        start = num_decodes
        for i in range(num_decodes, meta.num_seqs):
            q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            num_blocks = -(-seq_len // block_size)
            blocks = meta.block_tables[i, :num_blocks]
            out[start : start + q_len] = _prefill(
                query[start : start + q_len], k_cache, v_cache, blocks, seq_len, scale
            )
            start += q_len
        return out


def _leading_decodes(query_lens: list[int]) -> int:
    n = 0
    for q_len in query_lens:
        if q_len != 1:
            break
        n += 1
    return n


def _decode(query, k_cache, v_cache, meta: AttentionMetadata, scale: float, num_seqs: int) -> torch.Tensor:
    """query: [B, H, D], one token per request (the first B requests) -> [B, H, D]."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    max_blocks = -(-max(meta.seq_lens_cpu[:num_seqs]) // block_size)
    tables = meta.block_tables[:num_seqs, :max_blocks]  # [B, M]
    ctx_len = max_blocks * block_size

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [B, KV, M*block_size, D]
        return cache[tables].view(num_seqs, ctx_len, num_kv_heads, head_dim).transpose(1, 2)

    # Queries of one KV group act as G query rows against that group's keys: no KV repeat.
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, KV, G, D]
    positions = torch.arange(ctx_len, device=query.device)
    mask = (positions[None, :] < meta.seq_lens[:num_seqs, None]).view(num_seqs, 1, 1, ctx_len)
    out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(query, k_cache, v_cache, blocks, seq_len: int, scale: float) -> torch.Tensor:
    """query: [q_len, H, D], the last q_len of seq_len positions; blocks: [ceil(seq_len / block_size)]."""
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    k = k_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)  # [KV, S, D]
    v = v_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len].transpose(0, 1)
    q = query.transpose(0, 1)  # [H, q_len, D]
    if q_len == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query row r sits at position seq_len - q_len + r and sees every key up to it.
        rows = torch.arange(q_len, device=query.device)[:, None] + (seq_len - q_len)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= rows  # [q_len, S]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)  # [q_len, H, D]
