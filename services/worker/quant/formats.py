"""Packed weight formats and their plain-torch references.

A ``PackedWeight`` is an [N, K] matrix (N output channels, K inputs) stored row by row:

- ``int8``: int8 values and one float32 scale per output channel (``--quantization int8``,
  quantized at load from any checkpoint): w[n, k] = q[n, k] * scale[n].
- ``q8_0``, ``q4_0``, ``q4_1``: ggml's blocks of 32 values along K, as a GGUF file stores them
  (``--quantization gguf``). Per block: q8_0 = fp16 d + 32 int8 (w = d q); q4_0 = fp16 d + 16
  bytes of nibbles (w = d (q - 8)); q4_1 = fp16 d + fp16 m + 16 bytes (w = d q + m). Byte j of
  a block's nibbles holds value j in its low half and value j + 16 in its high half.

Every function here is the slow, obvious definition the native kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # values per ggml block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}
FORMAT_CODES = {"int8": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3}  # see quant_kernels.c


@dataclass(slots=True)
class PackedWeight:
    format: str  # a key of FORMAT_CODES
    data: torch.Tensor  # int8: [N, K] int8; ggml formats: [N, K / 32 * block bytes] uint8
    num_cols: int  # K
    scales: torch.Tensor | None = None  # int8: [N] float32

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.num_cols

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * 4
        return self.data.numel() * self.data.element_size() + extra

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """The rows ``index`` (an embedding lookup, or a permutation of output channels)."""
        scales = None if self.scales is None else self.scales[index]
        return PackedWeight(self.format, self.data[index].contiguous(), self.num_cols, scales)


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack along N (fused q/k/v, gate/up); all parts share one format and K."""
    first = parts[0]
    if any(p.format != first.format or p.num_cols != first.num_cols for p in parts):
        raise ValueError("fused weights must share one packed format and width")
    scales = None if first.scales is None else torch.cat([p.scales for p in parts])
    return PackedWeight(first.format, torch.cat([p.data for p in parts]).contiguous(), first.num_cols, scales)


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Symmetric per-output-channel int8: scale = max |w| / 127 per row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return PackedWeight("int8", q.contiguous(), w.shape[1], scales.contiguous())


def _blocks(packed: PackedWeight) -> torch.Tensor:  # [N, K / 32, block bytes] uint8
    n, k = packed.shape
    return packed.data.view(n, k // BLOCK, BLOCK_BYTES[packed.format])


def _fp16(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def block_values(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(integer values [N, K/32, 32] int32, d [N, K/32], m [N, K/32] or None) of a ggml format."""
    blocks = _blocks(packed)
    d = _fp16(blocks[..., 0:2])
    if packed.format == "q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).int(), d, None
    start = 4 if packed.format == "q4_1" else 2
    nibbles = blocks[..., start : start + 16].int()
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # low halves are values 0-15, high 16-31
    if packed.format == "q4_0":
        return q - 8, d, None
    return q, d, _fp16(blocks[..., 2:4])


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The float32 [N, K] matrix the packed one stands for."""
    if packed.format == "int8":
        return packed.data.float() * packed.scales[:, None]
    q, d, m = block_values(packed)
    w = q.float() * d[..., None]
    if m is not None:
        w = w + m[..., None]
    return w.reshape(packed.shape)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row in blocks of 32 (zero-padded): int8 values q [M, B, 32] and scales d [M, B], x ~ d q.

    d = max |x| / 127 per block, q = round(x / d): the activation side of ggml's q8 dot products."""
    m, k = x.shape
    num_blocks = -(-k // BLOCK)
    padded = torch.zeros(m, num_blocks * BLOCK, dtype=torch.float32)
    padded[:, :k] = x.float()
    blocks = padded.view(m, num_blocks, BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).clamp_(-127, 127).int()
    return q, d


def reference_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the native quantized GEMV computes, in float64: x quantized per block, integer dot
    products per block, scaled by the weight's and the activation's block scales. [M, K] -> [M, N] float32."""
    qx, dx = quantize_activations(x)  # [M, B, 32], [M, B]
    n, k = packed.shape
    if packed.format == "int8":
        w = torch.zeros(n, qx.shape[1] * BLOCK, dtype=torch.int64)
        w[:, :k] = packed.data.long()
        sums = torch.einsum("mbj,nbj->mnb", qx.long(), w.view(n, -1, BLOCK)).double()  # exact integers
        out = (sums * dx.double()[:, None, :]).sum(-1) * packed.scales.double()[None, :]
    else:
        q, d, m = block_values(packed)
        sums = torch.einsum("mbj,nbj->mnb", qx.long(), q.long()).double()
        out = (sums * d.double()[None] * dx.double()[:, None, :]).sum(-1)
        if m is not None:  # sum_j (d q_j + m) x_j = d (q . x) + m sum_j x_j
            x_sums = qx.sum(-1).double() * dx.double()  # [M, B]
            out = out + (x_sums[:, None, :] * m.double()[None]).sum(-1)
    if bias is not None:
        out = out + bias.double()
    return out.float()
