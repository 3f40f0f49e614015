"""Keys of KV blocks in a store shared across processes, groups and restarts (the Redis KV tier).

The in-process prefix cache keys blocks by Python's 64-bit ``hash()`` and compares tokens on a hit; a
shared store cannot compare tokens, so its keys are strong digests instead: BLAKE2b over the parent
key and the block's token ids, seeded with a namespace naming everything that shapes the bytes (model,
dtype, block size, bytes per block, layout version). Two processes agree on a key exactly when they
would compute the same K/V. The scheduler derives keys, the worker checks that the value it reads
names the same key and namespace (``services.worker.kv_transfer.layout``).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from services.common.block_hash import mm_block_keys

# Bump when the byte layout of a stored block changes: old values then never match.
LAYOUT_VERSION = 2
KEY_PREFIX = "kvgrid:kv:"


def namespace(model: str, dtype: str, block_size: int, bytes_per_block: int) -> str:
    """What a block's bytes depend on besides its tokens."""
    return f"{model}|{dtype}|bs={block_size}|bytes={bytes_per_block}|layout={LAYOUT_VERSION}"


def extend_keys(
    keys: list[str],
    ns: str,
    token_ids: Sequence[int],
    block_size: int,
    limit: int,
    mm_spans: Sequence[tuple[int, int, str]] = (),
) -> list[str]:
    """Append the keys of full blocks of ``token_ids`` not keyed yet, up to ``limit`` blocks; returns ``keys``.
    A block that covers image placeholders (``mm_spans``: offset, length, image hash) has the images in its key."""
    num_full = min(len(token_ids) // block_size, limit)
    parent = bytes.fromhex(keys[-1][len(KEY_PREFIX) :]) if keys else ns.encode()
    for i in range(len(keys), num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        data = parent + struct.pack(f"<{block_size}I", *block)
        for mm_hash, rel in mm_block_keys(mm_spans, i * block_size, (i + 1) * block_size):
            data += f"|img:{mm_hash}@{rel}".encode()
        digest = hashlib.blake2b(data, digest_size=20).digest()
        keys.append(KEY_PREFIX + digest.hex())
        parent = digest
    return keys
