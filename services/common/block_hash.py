"""The chained hash of a full KV block, shared by the scheduler's prefix cache and the frontend's router.

A block's hash covers its parent's hash, its own token ids and extra keys, so
equal hashes mean equal prefixes up to and including the block. Schedulers
publish the hashes they hold (``KvEvents``); a frontend hashes a prompt the same
way to tell how much of it each scheduler has cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

# The parent value of a prompt's first block. Not None: before Python 3.12 hash(None) is its address, which
# differs between processes, and frontends must compute the schedulers' values.
ROOT = 0


def mm_block_keys(mm_spans: Sequence[tuple[int, int, str]], start: int, end: int) -> tuple:
    """The extra keys of the block of positions [start, end) from the prompt's images, each an (offset, length,
    content hash) span of placeholder tokens: (hash, where the image's run starts relative to the block) for each
    image the block overlaps. Placeholders are equal tokens whatever the image, so only these keys tell two
    images apart: the same image hits, another with the same placeholders never does."""
    return tuple((h, offset - start) for offset, length, h in mm_spans if offset < end and offset + length > start)


def chain_hash(parent: int | None, token_ids: tuple[int, ...], extra_keys: tuple = ()) -> int:
    # hash() of a tuple of ints is the same in every process: PYTHONHASHSEED only salts str/bytes.
    return hash((ROOT if parent is None else parent, token_ids, extra_keys))


def cache_salt(lora_name: str) -> int | None:
    """A request-level seed of the chain (the first block's parent): requests of different LoRA adapters never share
    a block, those of one adapter do. None for the base model. A digest, not ``hash()``: str hashes are salted per
    process, and frontends must compute the schedulers' values."""
    if not lora_name:
        return None
    return int.from_bytes(hashlib.blake2b(b"lora:" + lora_name.encode(), digest_size=8).digest(), "little")


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, salt: int | None = None) -> list[int]:
    """The hashes of the full blocks of ``token_ids``, first block first; ``salt``: see ``cache_salt``."""
    hashes: list[int] = []
    parent = salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes
