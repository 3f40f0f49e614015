"""The attention backend interface: what a forward pass hands the attention math.

A step is one flat batch of tokens from many requests (varlen, no padding to the
longest request). Request i owns query rows ``query_start_loc[i] : query_start_loc[i+1]``;
they are the *last* ``q_len_i`` positions of its ``seq_lens[i]`` tokens, so
attention is causal within the new tokens and full over the cached ones.

KV cache layout, one tensor pair per layer (the runner owns them, layers get views):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
Token t of request i lives in block ``block_tables[i, t // block_size]`` at offset
``t % block_size``; its slot is ``block_id * block_size + offset``.

Sliding window (``window`` > 0, per layer): the query at position p sees the keys at positions
p - window < k <= p (Hugging Face's rule). Blocks wholly before the window of a request's first
new token are never read, so the scheduler may free them and hand them to another request while
the table still names them (see ``services/scheduler/kv_cache_manager.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step batch description, built once per step as tensors on the model's device."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_seqs] int32, tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot of each new token
    max_query_len: int  # longest q_len in the batch (1 for a decode-only step)
    max_seq_len: int  # longest seq_len in the batch
    # Host copies of the lengths, for backends that plan on the CPU (e.g. the torch backend).
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_leading_decodes(self) -> int:
        """Requests before the first with several new tokens (the runner puts decodes first)."""
        count = 0
        for q_len in self.query_lens_cpu:
            if q_len != 1:
                break
            count += 1
        return count


class AttentionBackend(ABC):
    """Stateless attention math over a paged KV cache; one instance serves every layer."""

    name: str = "base"

    @abstractmethod
    def write_kv(
        self,
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        """Scatter the step's new keys and values into their cache slots."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Attention of each new token over its request's cached and new tokens (already written), over the last
        ``window`` positions only when ``window`` > 0."""
