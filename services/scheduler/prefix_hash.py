"""Hash chains over full KV blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and extra keys
(anything else that changes the block's K/V), so equal hashes mean equal
prefixes up to and including the block. The hash object keeps the tokens and
the parent value too, so a cache hit is verified by comparison, not trusted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.block_hash import chain_hash, mm_block_keys


@dataclass(slots=True, frozen=True)
class BlockHash:
    value: int
    parent: int | None
    token_ids: tuple[int, ...]
    extra_keys: tuple = ()


def hash_block_tokens(
    parent: BlockHash | None, token_ids: Sequence[int], extra_keys: tuple = (), salt: int | None = None
) -> BlockHash:
    """``salt``: the first block's parent value (a request-level seed, see ``block_hash.cache_salt``)."""
    parent_value = parent.value if parent is not None else salt
    tokens = tuple(token_ids)
    return BlockHash(chain_hash(parent_value, tokens, extra_keys), parent_value, tokens, extra_keys)


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple = (),
    mm_spans: Sequence[tuple[int, int, str]] = (),
    salt: int | None = None,
) -> list[BlockHash]:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet; returns ``hashes``. ``extra_keys``
    go into every block's hash; ``mm_spans`` (offset, length, image hash) into the blocks each image overlaps;
    ``salt`` seeds the chain of the request (its LoRA adapter, see ``block_hash.cache_salt``)."""
    num_full = len(token_ids) // block_size
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        start, end = i * block_size, (i + 1) * block_size
        keys = extra_keys + mm_block_keys(mm_spans, start, end) if mm_spans else extra_keys
        parent = hash_block_tokens(parent, token_ids[start:end], keys, salt)
        hashes.append(parent)
    return hashes
