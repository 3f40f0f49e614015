"""A small K-quant quantizer for tests (the ``gguf`` package dequantizes Q4_K / Q5_K / Q6_K but cannot
quantize them): float rows -> ggml's super-block bytes, following ggml's block layouts
(``services/worker/quant/kquants.py``). Min/max scales rounded up (no value clips), not ggml's searched
ones: the tests check the layout through ``gguf.quants.dequantize`` and need only a faithful, not an
optimal, quantization.
"""

from __future__ import annotations

import numpy as np

GGML_NAMES = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


def _fp16_bytes(values: np.ndarray) -> np.ndarray:  # [...] -> [..., 2] uint8
    return values.astype(np.float16)[..., None].view(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [B, 8] -> ggml's 12 bytes [B, 12] (the inverse of get_scale_min_k4)."""
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _quantize_q45(x: np.ndarray, levels: int) -> tuple[np.ndarray, ...]:
    """Blocks [B, 256] -> (d, dmin [B] float16 values, sc, m [B, 8], q [B, 8, 32] in 0..levels)."""
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale = (sub.max(-1) - low) / levels
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float32)
    dmin = (-low.min(-1) / 63).astype(np.float16).astype(np.float32)
    safe = np.where(d > 0, d, 1.0)[:, None]
    sc = np.clip(np.ceil(scale / safe), 0, 63).astype(np.uint8)
    m = np.clip(np.ceil(-low / np.where(dmin > 0, dmin, 1.0)[:, None]), 0, 63).astype(np.uint8)
    step = d[:, None] * sc
    q = np.round((sub + (dmin[:, None] * m)[..., None]) / np.where(step > 0, step, 1.0)[..., None])
    return d, dmin, sc, m, np.clip(q, 0, levels).astype(np.uint8)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[B, 8, 32] values (low four bits used) -> [B, 128]: sub-block 2i low halves, 2i + 1 high ones."""
    pairs = q.reshape(-1, 4, 2, 32) & 15
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128).astype(np.uint8)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _quantize_q45(x, 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales(sc, m), _nibbles(q)], axis=-1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _quantize_q45(x, 31)
    qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1).astype(np.uint8)  # bit j: sub-block j
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), _pack_scales(sc, m), qh, _nibbles(q)], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    groups = x.reshape(-1, 16, 16)
    scale = np.abs(groups).max(-1) / 31
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.ceil(scale / np.where(d > 0, d, 1.0)[:, None]), -128, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.round(groups / np.where(step != 0, step, 1.0)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # half, c, l: value 128 half + 32 c + l
    low = q & 15
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = sum(((q[:, :, c] >> 4) & 3) << (2 * c) for c in range(4))
    return np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64).astype(np.uint8), sc.view(np.uint8), _fp16_bytes(d)], axis=-1
    )


def quantize(weight: np.ndarray, fmt: str) -> np.ndarray:
    """Float [N, K] (K a multiple of 256) -> [N, K / 256 * block bytes] uint8 in ``fmt``."""
    n, k = weight.shape
    blocks = weight.astype(np.float32).reshape(-1, 256)
    raw = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}[fmt](blocks)
    return np.ascontiguousarray(raw.astype(np.uint8)).reshape(n, -1)
