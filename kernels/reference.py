"""Slow, obvious torch references for every kernel, with the kernels' signatures.

They gather through the block table one request at a time and compute in float32,
so a kernel test compares against something that is easy to check by eye.
"""

from __future__ import annotations

import math

import torch


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    tile_n: int = 32,  # kernel tuning knobs, ignored here
    num_splits: int = 1,
    window: int = 0,  # > 0: a query at p sees the keys at p - window < k <= p
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    num_heads = query.shape[1]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    queries_per_kv = num_heads // num_kv_heads
    starts = query_start_loc.tolist()
    result = torch.empty_like(query) if out is None else out
    for i, seq_len in enumerate(seq_lens.tolist()):
        q = query[starts[i] : starts[i + 1]].float()  # [q_len, num_heads, head_dim]
        q_len = q.shape[0]
        assert q_len <= max_query_len
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long().to(k_cache.device)
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()  # [seq_len, kv_heads, d]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:seq_len].float()
        k = k.repeat_interleave(queries_per_kv, dim=1)  # [seq_len, num_heads, head_dim]
        v = v.repeat_interleave(queries_per_kv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(seq_len, device=query.device)[None, :]
        hidden = (k_pos > q_pos) | (k_pos <= q_pos - window) if window > 0 else k_pos > q_pos
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = scores.softmax(dim=-1)
        result[starts[i] : starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return result


def split_kv_reduce_reference(
    partial_out: torch.Tensor,  # [num_tokens, num_heads, num_splits, head_pad] float32
    partial_lse: torch.Tensor,  # [num_tokens, num_heads, num_splits] float32, log2-sum-exp2, -inf = empty
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim], written in place
) -> None:
    """Each split's output weighted by its share of the total softmax mass, 2**lse_j / sum_j 2**lse_j."""
    head_dim = out.shape[-1]
    weights = torch.softmax(partial_lse * math.log(2.0), dim=-1)  # [num_tokens, num_heads, num_splits]
    out.copy_((weights[..., None] * partial_out[..., :head_dim]).sum(dim=2).to(out.dtype))


def kv_cache_write_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, negative = padding token, skipped
) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def rms_norm_reference(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> tuple[torch.Tensor, torch.Tensor | None]:  # normed [num_tokens, hidden], new residual or None
    """Llama RMSNorm; with ``residual``, normalizes x + residual and also returns that sum."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        residual = x
    h = x.float()
    normed = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype), residual


def fused_moe_reference(
    x: torch.Tensor,  # [T, E]
    w13: torch.Tensor,  # [num_experts, 2 * I, E], gate rows then up rows
    w2: torch.Tensor,  # [num_experts, E, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int
    block_m: int = 16,  # kernel tuning knob, ignored here
) -> torch.Tensor:  # [T, E]
    """Token by token, expert by expert, in float32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for weight, expert in zip(topk_weights[t].tolist(), topk_ids[t].tolist(), strict=True):
            h = w13[expert].float() @ x[t].float()  # [2I]
            act = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += weight * (w2[expert].float() @ act)
    return out.to(x.dtype)
