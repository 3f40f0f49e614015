"""One KV block as a self-describing byte string: a header naming what it is, then K and V of all layers.

Value = ``MAGIC`` + 4-byte little-endian header length + JSON header + payload. The header names the key and
namespace the block was written under, its tensor shape and dtype, the payload length and its XXH3-64 hash; a
reader rejects a value whose header does not match what it asked for in every one of those, so a value
written by another model, dtype or block size, a truncated value and a corrupted one all read as missing
(and are recomputed), never as wrong K/V. Payload: the block's ``[layers, 2 (K, V), block_size, kv_heads,
head_dim]`` tensor, contiguous, in native byte order.
"""

from __future__ import annotations

import json
import struct
import warnings

import numpy as np
import torch
import xxhash

MAGIC = b"KVGRIDKV"
_LEN = struct.Struct("<I")


class BadBlock(ValueError):
    """A stored value that is not the block asked for."""


def encode(key: str, namespace: str, block: torch.Tensor) -> bytes:
    """``block``: a CPU tensor [layers, 2, block_size, kv_heads, head_dim]; the whole value, as one byte string."""
    head, body = split_encode(key, namespace, block)
    return head + body.tobytes()


def split_encode(key: str, namespace: str, block: torch.Tensor) -> tuple[bytes, np.ndarray]:
    """The value as its head (magic, header) and its payload: ``block``'s own bytes where it is contiguous."""
    payload = block.contiguous().view(torch.uint8).reshape(-1).numpy()
    header = json.dumps(
        {
            "key": key,
            "namespace": namespace,
            "shape": list(block.shape),
            "dtype": str(block.dtype).removeprefix("torch."),
            "nbytes": len(payload),
            "xxh3": xxhash.xxh3_64_intdigest(payload),
        }
    ).encode()
    return MAGIC + _LEN.pack(len(header)) + header, payload


def decode(
    value: bytes | memoryview, key: str, namespace: str, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """The block stored in ``value``, checked against what the reader expects; raises BadBlock. The tensor is a
    view of ``value``'s memory."""
    value = memoryview(value)
    if len(value) < len(MAGIC) + _LEN.size or value[: len(MAGIC)] != MAGIC:
        raise BadBlock("not a kvgrid KV block")
    start = len(MAGIC) + _LEN.size
    (header_len,) = _LEN.unpack_from(value, len(MAGIC))
    try:
        header = json.loads(bytes(value[start : start + header_len]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadBlock(f"unreadable header: {exc}") from exc
    if not isinstance(header, dict):
        raise BadBlock("unreadable header")
    want = {"key": key, "namespace": namespace, "shape": list(shape), "dtype": str(dtype).removeprefix("torch.")}
    for name, expected in want.items():
        if header.get(name) != expected:
            raise BadBlock(f"{name} is {header.get(name)!r}, expected {expected!r}")
    payload_start = start + header_len
    nbytes = len(value) - payload_start
    if header.get("nbytes") != nbytes or nbytes != int(np.prod(shape)) * dtype.itemsize:
        raise BadBlock(f"payload of {nbytes} bytes, header says {header.get('nbytes')}")
    view = value[payload_start:]
    if xxhash.xxh3_64_intdigest(view) != header.get("xxh3"):
        raise BadBlock("payload checksum mismatch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: the tensor is only copied from
        raw = torch.from_numpy(np.frombuffer(view, dtype=np.uint8))
    return raw.view(dtype).view(shape)
