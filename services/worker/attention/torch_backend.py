"""Attention in plain torch over the paged cache, for CPU and CUDA.

Decodes (one new token) are batched: the leading run of decode requests gathers its
blocks in one indexing op and runs one SDPA call with a length mask, the query heads of
each KV group standing in for the query length. Requests with several new tokens (prefill
chunks) run one SDPA call each over their own blocks; there are few of them per step.
The runner puts decodes first, so a mixed step takes the batched path for all its decodes.
On CPU with the native kernels, ``native_decode`` (set by the engine) takes those decodes
instead: paged attention straight over the block tables, with no gather of whole contexts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.worker.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # The decode plan depends only on the step's metadata: built by the first layer, reused by the others.
        self._plan_for: AttentionMetadata | None = None
        self._plan: _DecodePlan | None = None
        # (query [B, H, D], k_cache, v_cache, meta, B, scale, window) -> [B, H, D] for the first B requests (decodes).
        self.native_decode: Callable | None = None

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)

    def forward(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
        gather = self.native_decode is None
        if self._plan_for is not meta or self._plan.gathered != gather:
            self._plan_for = meta
            self._plan = _DecodePlan.build(meta, k_cache.shape[1], query.dtype, gather)
        plan = self._plan
        if plan.num_seqs == meta.num_seqs:
            return self._decodes(query, k_cache, v_cache, meta, scale, window)
        out = torch.empty_like(query)
        if plan.num_seqs:
            out[: plan.num_seqs] = self._decodes(query[: plan.num_seqs], k_cache, v_cache, meta, scale, window)
        block_size = k_cache.shape[1]
        start = plan.num_seqs
        for i in range(plan.num_seqs, meta.num_seqs):
            q_len, seq_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
            blocks = meta.block_tables[i, : -(-seq_len // block_size)]
            out[start : start + q_len] = _prefill(
                query[start : start + q_len], k_cache, v_cache, blocks, seq_len, scale, window
            )
            start += q_len
        return out

    def _decodes(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int) -> torch.Tensor:
        """The leading run of decode requests: [B, H, D] -> [B, H, D]."""
        if self.native_decode is not None:
            return self.native_decode(query, k_cache, v_cache, meta, self._plan.num_seqs, scale, window)
        return _decode(query, k_cache, v_cache, self._plan, scale, window)


@dataclass(slots=True)
class _DecodePlan:
    """The leading run of single-token requests, gathered as one batch."""

    num_seqs: int
    block_ids: torch.Tensor  # [B * M] int64, the block tables of the B decodes, M blocks each
    # [B, 1, 1, M * block_size] additive, 0 inside the sequence and -inf past it: SDPA on CPU turns a
    # bool mask into this form on every call (twice the cost of the attention itself at batch 1).
    mask: torch.Tensor
    gathered: bool = True  # False: only num_seqs is set (native_decode reads the block tables itself)
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int32, of the decodes
    seq_lens: torch.Tensor | None = None  # [B] int32, of the decodes
    block_size: int = 0
    windowed: dict[int, _DecodePlan] = field(default_factory=dict)  # window -> its plan, built by the first layer

    def for_window(self, window: int) -> _DecodePlan:
        """The plan over each decode's last ``window`` positions only: its blocks from the first one the window
        touches (earlier ones may have been freed and reused), the keys before the window masked."""
        if not window:
            return self
        if window not in self.windowed:
            bs, dev = self.block_size, self.block_ids.device
            first = (self.seq_lens - window).clamp(min=0) // bs  # [B] first block in the window
            last = -(-self.seq_lens // bs) - 1  # [B] last block; shorter rows repeat it (masked)
            width = int((last - first).max()) + 1
            columns = torch.minimum(first[:, None] + torch.arange(width, device=dev)[None, :], last[:, None])
            block_ids = self.block_tables.gather(1, columns).reshape(-1).long()
            positions = (first[:, None] * bs + torch.arange(width * bs, device=dev)[None, :]).long()
            ends = self.seq_lens[:, None].long()
            outside = ((positions >= ends) | (positions < ends - window)).view(len(first), 1, 1, -1)
            mask = torch.zeros(outside.shape, dtype=self.mask.dtype, device=dev).masked_fill_(outside, float("-inf"))
            self.windowed[window] = _DecodePlan(self.num_seqs, block_ids, mask)
        return self.windowed[window]

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype, gather: bool = True) -> _DecodePlan:
        """``gather``: False counts the decodes only (a native kernel reads the block tables itself)."""
        num_seqs = meta.num_leading_decodes
        if num_seqs == 0 or not gather:
            return cls(num_seqs, meta.slot_mapping[:0], meta.slot_mapping[:0].to(dtype), gather)
        max_blocks = -(-max(meta.seq_lens_cpu[:num_seqs]) // block_size)
        block_ids = meta.block_tables[:num_seqs, :max_blocks].reshape(-1).long()
        positions = torch.arange(max_blocks * block_size, device=block_ids.device)
        outside = (positions[None, :] >= meta.seq_lens[:num_seqs, None]).view(num_seqs, 1, 1, -1)
        mask = torch.zeros(outside.shape, dtype=dtype, device=block_ids.device).masked_fill_(outside, float("-inf"))
        return cls(num_seqs, block_ids, mask, True, meta.block_tables[:num_seqs], meta.seq_lens[:num_seqs], block_size)


def _decode(query, k_cache, v_cache, plan: _DecodePlan, scale: float, window: int = 0) -> torch.Tensor:
    """query: [B, H, D], one token per request (the first B requests) -> [B, H, D]."""
    plan = plan.for_window(window)
    _, _, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_heads = plan.num_seqs, query.shape[1]

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [B, KV, M * block_size, D]
        return cache.index_select(0, plan.block_ids).view(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)

    # Queries of one KV group act as G query rows against that group's keys: no KV repeat.
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, KV, G, D]
    out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), attn_mask=plan.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill(query, k_cache, v_cache, blocks, seq_len: int, scale: float, window: int = 0) -> torch.Tensor:
    """query: [q_len, H, D], the last q_len of seq_len positions; blocks: [ceil(seq_len / block_size)].

    Keys and values are repeated per query head and the call is batched (4-D): torch's fused
    attention kernel takes only that form; with ``enable_gqa`` or 3-D inputs SDPA falls back to its
    math path, which builds the [H, q_len, S] scores and mask in memory (on CPU far slower at long prompts).
    With a ``window`` only the blocks from the first one the first query sees are read."""
    q_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1:3]
    first = max(seq_len - q_len - window + 1, 0) // block_size if window else 0
    blocks = blocks[first:].long()
    offset = first * block_size  # position of the first gathered key

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [1, H, S, D]
        kv = cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[: seq_len - offset].transpose(0, 1)
        return kv.repeat_interleave(num_heads // num_kv_heads, dim=0)[None]

    q = query.transpose(0, 1)[None]  # [1, H, q_len, D]
    if q_len == seq_len and not window:
        out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), is_causal=True, scale=scale)
    else:
        # Query row r sits at position seq_len - q_len + r and sees every key up to it (within the window).
        rows = torch.arange(q_len, device=query.device)[:, None] + (seq_len - q_len)
        keys = torch.arange(offset, seq_len, device=query.device)[None, :]
        mask = keys <= rows  # [q_len, S]
        if window:
            mask &= keys > rows - window
        out = F.scaled_dot_product_attention(q, gather(k_cache), gather(v_cache), attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)  # [q_len, H, D]
