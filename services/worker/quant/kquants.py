"""ggml's K-quant super-blocks (``q4_k``, ``q5_k``, ``q6_k``) in plain torch: the native kernels' reference.

A super-block holds 256 values along K (a GGUF stores K-quant matrices only where K is a multiple of 256):

- ``q4_k`` (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc[8] and mins m[8] (ggml's
  ``get_scale_min_k4`` packing), 128 bytes of nibbles. Sub-block j of 32 values is d sc[j] q - dmin m[j],
  q in 0..15; each 32 bytes of nibbles hold sub-block 2i in their low halves and 2i + 1 in their high ones.
- ``q5_k`` (176 bytes): as q4_k with 32 bytes qh between the scales and the nibbles: bit j of qh[l] is the
  fifth bit of value l of sub-block j (q in 0..31).
- ``q6_k`` (210 bytes): 128 bytes ql (low four bits), 64 bytes qh (high two bits), 16 int8 scales, fp16 d.
  Group g of 16 values is d sc[g] (q - 32), q in 0..63. Per half (128 values) value 32c + l (c < 4) takes
  the low (c < 2) or high nibble of ql[32 (c % 2) + l] and bits 2c, 2c + 1 of qh[l].

``group_values`` turns any of them into one shape: signed integer values per group of 16, one float scale
per group and one float offset per 32 values, w = scale q + offset, the same float32 products ggml's (and
``gguf``'s) dequantization takes, so dequantizing reproduces theirs bit for bit.
"""

from __future__ import annotations

import torch

SUPER = 256  # values per super-block
K_BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
GROUP = 16  # values per scale (q4_k and q5_k repeat each sub-block's scale on its two groups)


def _fp16(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def scales_and_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k / q5_k's 12 bytes [..., 12] -> 6-bit scales and mins [..., 8] (int32), as ggml's get_scale_min_k4."""
    q = packed.int()
    low_sc, low_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    high_sc = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)
    high_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat([low_sc, high_sc], -1), torch.cat([low_m, high_m], -1)


def _nibble_pairs(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 128] nibbles -> [N, B, 8, 32]: sub-block 2i from the low halves of bytes 32i.., 2i + 1 the high."""
    n, b = qs.shape[:2]
    chunks = qs.int().view(n, b, 4, 1, 32)
    return torch.cat([chunks & 15, chunks >> 4], dim=3).view(n, b, 8, 32)


def group_values(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Super-blocks [N, B, bytes] uint8 -> (q [N, B * 16, 16] int32, scale [N, B * 16], offset [N, B * 8]) float32."""
    n, b = blocks.shape[:2]
    if fmt == "q6_k":
        ql, qh = blocks[..., :128].int().view(n, b, 2, 64), blocks[..., 128:192].int().view(n, b, 2, 1, 32)
        low = torch.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], dim=3)
        high = (qh >> torch.tensor([0, 2, 4, 6]).view(4, 1)) & 3  # [N, B, 2, 4, 32]
        q = (low | (high << 4)) - 32
        scale = _fp16(blocks[..., 208:210])[..., None] * blocks[..., 192:208].contiguous().view(torch.int8).float()
        return q.reshape(n, b * 16, GROUP), scale.reshape(n, b * 16), torch.zeros(n, b * 8)
    d, dmin = _fp16(blocks[..., 0:2])[..., None], _fp16(blocks[..., 2:4])[..., None]
    sc, m = scales_and_mins(blocks[..., 4:16])
    if fmt == "q4_k":
        q = _nibble_pairs(blocks[..., 16:144])
    else:  # q5_k
        qh = blocks[..., 16:48].int().view(n, b, 1, 32)
        q = _nibble_pairs(blocks[..., 48:176]) | (((qh >> torch.arange(8).view(8, 1)) & 1) << 4)
    scale = (d * sc.float()).repeat_interleave(2, dim=-1)  # each sub-block's scale on its two groups
    offset = -(dmin * m.float())
    return q.reshape(n, b * 16, GROUP), scale.reshape(n, b * 16), offset.reshape(n, b * 8)


def dequantize(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """Super-blocks [N, B, bytes] -> float32 [N, B * 256]."""
    q, scale, offset = group_values(blocks, fmt)
    n = q.shape[0]
    w = (scale[..., None] * q.float()).view(n, -1, 32)
    if fmt != "q6_k":  # (q6_k has no offsets; adding zeros would only turn -0.0 into 0.0)
        w = w + offset[..., None]
    return w.reshape(n, -1)


def reference_sums(qx: torch.Tensor, dx: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """x W^T in float64 for x quantized per block of 32 (values qx [M, K / 32, 32], scales dx [M, K / 32]):
    exact integer dot products per group of 16, times the group's scale and x's block scale, plus each
    32 values' offset times x's block sum. [M, N]."""
    q, scale, offset = group_values(blocks, fmt)
    m = qx.shape[0]
    groups = qx.reshape(m, -1, GROUP).long()
    sums = torch.einsum("mgj,ngj->mng", groups, q.long()).double()  # exact integers
    dx_groups = dx.double().repeat_interleave(2, dim=-1)  # x's block scale on its two groups
    out = (sums * scale.double()[None] * dx_groups[:, None, :]).sum(-1)
    x_sums = qx.sum(-1).double() * dx.double()  # [M, K / 32]
    return out + (x_sums[:, None, :] * offset.double()[None]).sum(-1)
