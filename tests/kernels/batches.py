"""Random paged batches for kernel tests: shuffled block tables, mixed prefill chunks and decodes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Native kernels on a CUDA machine; elsewhere the interpreter, which runs on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    max_query_len: int

    def args(self) -> tuple:
        """Positional arguments of paged_attention and its reference, up to ``scale``."""
        return (self.query, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc, self.seq_lens)


# (q_len, seq_len) pairs: a prefill chunk over a cached prefix, decodes, a whole short prompt,
# a decode at a block boundary, odd lengths everywhere.
MIXED = [(13, 37), (1, 1), (1, 33), (5, 5), (1, 16), (27, 27), (1, 50)]
DECODES = [(1, 9), (1, 31), (1, 32), (1, 47)]


def random_batch(
    lens: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    spare_blocks: int = 5,
) -> PagedBatch:
    """Each request gets distinct blocks drawn at random from the pool (so order in memory is scrambled).
    Tensors live on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(lens), max(blocks_per_seq), dtype=torch.int32)
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    q_lens = [q_len for q_len, _ in lens]
    return PagedBatch(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype),
        k_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        v_cache=torch.randn(cache_shape, generator=gen).to(DEVICE, dtype),
        block_tables=block_tables.to(DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([seq_len for _, seq_len in lens], dtype=torch.int32, device=DEVICE),
        max_query_len=max(q_lens),
    )
