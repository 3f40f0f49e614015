"""Packed weight formats and their plain-torch references.

A ``PackedWeight`` is an [N, K] matrix (N output channels, K inputs) stored row by row:

- ``int8``: int8 values and one float32 scale per output channel (``--quantization int8``,
  quantized at load from any checkpoint): w[n, k] = q[n, k] * scale[n].
- ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``: ggml's blocks of 32 values along K, as a GGUF file stores them
  (``--quantization gguf``). Per block: q8_0 = fp16 d + 32 int8 (w = d q); q4_0 = fp16 d + 16
  bytes of nibbles (w = d (q - 8)); q4_1 = fp16 d + fp16 m + 16 bytes (w = d q + m); q5_0 = fp16 d
  + 4 bytes qh (bit j: value j's fifth bit) + 16 bytes of nibbles (w = d (q - 16)). Byte j of a
  block's nibbles holds value j in its low half and value j + 16 in its high half.
- ``q4_k``, ``q5_k``, ``q6_k``: ggml's K-quant super-blocks of 256 values along K (``kquants``), as stored.

The native kernels read a tiled copy instead (``tile``; ``PackedWeight.tiled``): rows in tiles of
``TILE``, and per (tile, block of 32 along K) one record with the tile's fp16 scales d (q8_0, q4_*,
q5_0), then its fp16 offsets m (q4_1), then the values 4 bytes at a time, row after row: bytes 0-3 of
rows 0..7, then bytes 4-7, and so on (see ``quant_kernels.c`` for why); q5_0's records end with the 8
rows' fifth bits, 32 bytes in the order the kernels' vectors take the nibbles (``_fifth_bit_order``).
Tiling moves bits only: the same blocks, the same size (plus zero rows up to a whole tile, and for int8
zeros up to whole blocks). K-quant rows are not tiled: their kernel reads each row's super-blocks as
stored (``tile`` only marks them ready).

Every other function here is the slow, obvious definition the native kernels are tested against;
they take either layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from services.worker.quant import kquants

BLOCK = 32  # values per ggml block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, **kquants.K_BLOCK_BYTES}
# the format codes of quant_kernels.c
FORMAT_CODES = {"int8": 0, "q8_0": 1, "q4_0": 2, "q4_1": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6, "q5_0": 7}
TILE = 8  # rows per tile of the tiled layout
_QH_BYTES = {"q5_0": 4}  # bytes of fifth bits after a block's d


@dataclass(slots=True)
class PackedWeight:
    format: str  # a key of FORMAT_CODES
    data: torch.Tensor  # int8: [N, K] int8; ggml formats: [N, K / 32 * block bytes] uint8
    num_cols: int  # K
    scales: torch.Tensor | None = None  # int8: [N] float32
    num_rows: int = -1  # N; data has more rows once tiled (whole tiles)
    tiled: bool = False  # data in the kernels' tiled layout (see the module docstring)
    # int8 GEMM only, 1 or 2: 2 also quantizes each activation row's rounding error to int8 and adds its product
    # (one GEMM of twice the rows), for inputs whose outlier channels one scale per row represents poorly
    activation_terms: int = 1
    # int8 where the int8 GEMM takes only large steps (matmul.INT8_GEMM_ROWS > 1): the [N, K] rows as
    # stored, kept beside the tiled data the native kernel reads for small ones
    stored: torch.Tensor | None = None
    # the same values rounded to bfloat16 in AMX's tile layout (``matmul.with_amx_copy``), for batches of rows
    amx: torch.Tensor | None = None

    def __post_init__(self):
        if self.num_rows < 0:
            self.num_rows = self.data.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.num_rows, self.num_cols

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * 4
        extra += 0 if self.stored is None else self.stored.numel()
        extra += 0 if self.amx is None else self.amx.numel() * 2
        return self.data.numel() * self.data.element_size() + extra

    def rows(self, index: torch.Tensor) -> PackedWeight:
        """The rows ``index`` (an embedding lookup, or a permutation of output channels), untiled."""
        if self.tiled:
            return untile(self).rows(index)
        scales = None if self.scales is None else self.scales[index]
        return PackedWeight(
            self.format, self.data[index].contiguous(), self.num_cols, scales, activation_terms=self.activation_terms
        )


@dataclass(slots=True)
class PackedParts:
    """Packed matrices stacked along N in different formats: a fused q/k/v or gate/up whose parts a GGUF
    stores in different types. Each part multiplies on its own into its own output columns
    (``matmul.linear_into``). ``tiled`` is always False and ``amx`` None: a kernel call that takes one tiled matrix,
    or one matrix's AMX copy, declines it."""

    parts: list[PackedWeight]
    tiled: bool = False
    amx: None = None

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].num_cols

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def formats(self) -> list[str]:
        return [p.format for p in self.parts]

    def offsets(self) -> list[int]:
        """Each part's first output column."""
        starts = [0]
        for p in self.parts[:-1]:
            starts.append(starts[-1] + p.shape[0])
        return starts


def concat_rows(parts: list[PackedWeight]) -> PackedWeight:
    """Stack along N (fused q/k/v, gate/up); all parts share one format and K."""
    parts = [untile(p) for p in parts]
    first = parts[0]
    if any(p.format != first.format or p.num_cols != first.num_cols for p in parts):
        raise ValueError("fused weights must share one packed format and width")
    scales = None if first.scales is None else torch.cat([p.scales for p in parts])
    return PackedWeight(first.format, torch.cat([p.data for p in parts]).contiguous(), first.num_cols, scales)


def q5_0_as_q8_0(packed: PackedWeight) -> PackedWeight:
    """A q5_0 matrix as q8_0 blocks of the same values (34 bytes a block instead of 22): q5_0's w = d (q - 16),
    q in 0..31, is q8_0's w = d q' with q' = q - 16, and the kernels' products on the two are equal bit for bit."""
    q, _, _ = block_values(packed)
    blocks = _blocks(packed)
    data = torch.cat([blocks[..., :2], q.to(torch.int8).view(torch.uint8)], dim=-1)
    return PackedWeight("q8_0", data.reshape(packed.shape[0], -1).contiguous(), packed.num_cols)


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """Symmetric per-output-channel int8: scale = max |w| / 127 per row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return PackedWeight("int8", q.contiguous(), w.shape[1], scales.contiguous())


def is_kquant(fmt: str) -> bool:
    return fmt in kquants.K_BLOCK_BYTES


def block_width(fmt: str) -> int:
    """Values per stored block along K."""
    return kquants.SUPER if is_kquant(fmt) else BLOCK


def _record_layout(fmt: str) -> tuple[int, int]:
    """(fp16 fields per row in a block: d, and m for q4_1; 4-byte value chunks per row in a block)."""
    if fmt == "int8":
        return 0, BLOCK // 4
    return (2 if fmt == "q4_1" else 1), (BLOCK // 8 if fmt.startswith(("q4", "q5")) else BLOCK // 4)


def _fifth_bit_order() -> torch.Tensor:
    """Which of a tile's fifth bits (row r, value v: r * 32 + v) each of a q5_0 record's 256 takes, in the
    order of the nibbles the kernels load: per pair c of 64-byte vectors (chunks 2c and 2c + 1, 4 bytes of
    each row in turn), the low halves' bits, then the high halves' (values + 16)."""
    c, high, chunk, r, byte = torch.meshgrid(*(torch.arange(n) for n in (2, 2, 2, TILE, 4)), indexing="ij")
    return (r * BLOCK + 16 * high + 4 * (2 * c + chunk) + byte).reshape(-1)


def _q5_0_masks(qh: torch.Tensor) -> torch.Tensor:
    """[t, b, TILE, 4] uint8 qh (little-endian) -> [t, b, 32] uint8: the record's fifth bits in kernel order."""
    t, b = qh.shape[:2]
    bits = (qh.contiguous().view(torch.int32).long() >> torch.arange(BLOCK)) & 1  # [t, b, TILE, 32]
    ordered = bits.reshape(t, b, TILE * BLOCK)[..., _fifth_bit_order()]
    return (ordered.view(t, b, BLOCK, 8) << torch.arange(8)).sum(-1).to(torch.uint8)


def _q5_0_qh(masks: torch.Tensor) -> torch.Tensor:
    """``_q5_0_masks`` undone: [t, b, 32] uint8 -> [t, b, TILE, 4] uint8."""
    t, b = masks.shape[:2]
    bits = torch.empty(t, b, TILE * BLOCK, dtype=torch.int64)
    bits[..., _fifth_bit_order()] = ((masks.long()[..., None] >> torch.arange(8)) & 1).reshape(t, b, -1)
    qh = (bits.view(t, b, TILE, BLOCK) << torch.arange(BLOCK)).sum(-1, keepdim=True)
    return ((qh >> torch.arange(0, 32, 8)) & 255).to(torch.uint8)  # little-endian


def tile(packed: PackedWeight) -> PackedWeight:
    """The tiled copy the native kernels read (the same values; see the module docstring)."""
    if packed.tiled:
        return packed
    if is_kquant(packed.format):
        return replace(packed, tiled=True)
    n, k = packed.shape
    rows = -(-n // TILE) * TILE
    fields, chunks = _record_layout(packed.format)
    if packed.format == "int8":
        width = -(-k // BLOCK) * BLOCK
        blocks = torch.zeros(rows, width, dtype=torch.int8)
        blocks[:n, :k] = packed.data
        blocks = blocks.view(rows // TILE, TILE, width // BLOCK, BLOCK)
    else:
        width = packed.data.shape[1]
        blocks = torch.zeros(rows, width, dtype=torch.uint8)
        blocks[:n] = packed.data
        blocks = blocks.view(rows // TILE, TILE, k // BLOCK, BLOCK_BYTES[packed.format])
    blocks = blocks.transpose(1, 2)  # [tiles, blocks, TILE, block bytes]
    t, b = blocks.shape[:2]
    start = 2 * fields + _QH_BYTES.get(packed.format, 0)  # the values' first byte in a block
    header = blocks[..., : 2 * fields].reshape(t, b, TILE, fields, 2).transpose(2, 3)
    values = blocks[..., start:].reshape(t, b, TILE, chunks, 4).transpose(2, 3)
    record = [header.reshape(t, b, 2 * fields * TILE), values.reshape(t, b, 4 * chunks * TILE)]
    if packed.format == "q5_0":
        record.append(_q5_0_masks(blocks[..., 2 * fields : start]))
    return replace(packed, data=torch.cat(record, dim=-1).reshape(rows, width), tiled=True)


def untile(packed: PackedWeight) -> PackedWeight:
    """The row-by-row layout of a tiled weight (``tile`` undone)."""
    if not packed.tiled:
        return packed
    if packed.stored is not None:
        return replace(packed, data=packed.stored, tiled=False, stored=None)
    if is_kquant(packed.format):
        return replace(packed, tiled=False)
    n, k = packed.shape
    rows, width = packed.data.shape
    fields, chunks = _record_layout(packed.format)
    t, b = rows // TILE, -(-k // BLOCK)
    records = packed.data.reshape(t, b, -1)
    end = (2 * fields + 4 * chunks) * TILE  # the values' end in a record
    header = records[..., : 2 * fields * TILE].reshape(t, b, fields, TILE, 2).transpose(2, 3)
    values = records[..., 2 * fields * TILE : end].reshape(t, b, chunks, TILE, 4).transpose(2, 3)
    block = [header.reshape(t, b, TILE, 2 * fields), values.reshape(t, b, TILE, 4 * chunks)]
    if packed.format == "q5_0":
        block.insert(1, _q5_0_qh(records[..., end:]))
    data = torch.cat(block, dim=-1).transpose(1, 2).reshape(rows, width)[:n]
    if packed.format == "int8":
        data = data[:, :k]
    return replace(packed, data=data.contiguous(), tiled=False)


def _blocks(packed: PackedWeight) -> torch.Tensor:  # [N, K / block width, block bytes] uint8
    packed = untile(packed)
    n, k = packed.shape
    return packed.data.view(n, k // block_width(packed.format), BLOCK_BYTES[packed.format])


def _fp16(raw: torch.Tensor) -> torch.Tensor:  # [..., 2] uint8 -> [...] float32
    return raw.contiguous().view(torch.float16).squeeze(-1).float()


def block_values(packed: PackedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(integer values [N, K/32, 32] int32, d [N, K/32], m [N, K/32] or None) of a ggml format."""
    blocks = _blocks(packed)
    d = _fp16(blocks[..., 0:2])
    if packed.format == "q8_0":
        return blocks[..., 2:].contiguous().view(torch.int8).int(), d, None
    start = {"q4_1": 4, "q5_0": 6}.get(packed.format, 2)
    nibbles = blocks[..., start : start + 16].int()
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)  # low halves are values 0-15, high 16-31
    if packed.format == "q4_0":
        return q - 8, d, None
    if packed.format == "q5_0":
        qh = blocks[..., 2:6].contiguous().view(torch.int32).long()  # [N, B, 1]
        return (q | ((qh >> torch.arange(BLOCK)) & 1).int() << 4) - 16, d, None
    return q, d, _fp16(blocks[..., 2:4])


def dequantize(packed: PackedWeight) -> torch.Tensor:
    """The float32 [N, K] matrix the packed one stands for."""
    packed = untile(packed)
    if packed.format == "int8":
        return packed.data.float() * packed.scales[:, None]
    if is_kquant(packed.format):
        return kquants.dequantize(_blocks(packed), packed.format)
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
    packed = untile(packed)
    n, k = packed.shape
    if packed.format == "int8":
        w = torch.zeros(n, qx.shape[1] * BLOCK, dtype=torch.int64)
        w[:, :k] = packed.data.long()
        sums = torch.einsum("mbj,nbj->mnb", qx.long(), w.view(n, -1, BLOCK)).double()  # exact integers
        out = (sums * dx.double()[:, None, :]).sum(-1) * packed.scales.double()[None, :]
    elif is_kquant(packed.format):  # (K is whole super-blocks, so x has no padding)
        out = kquants.reference_sums(qx, dx, _blocks(packed), packed.format)
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


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row to int8 with one scale: (q [M, K] int8, scale [M, 1]), x ~ scale q, scale = max |x| / 127."""
    amax = x.abs().amax(dim=1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div_(amax), 0.0)  # a true division, as the kernel
    return torch.round(x * inv).to(torch.int8), amax / 127.0


def reference_int8_gemm(
    x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, int_mm: Callable | None = None
) -> torch.Tensor:
    """What the int8 GEMM path computes: x quantized per row, exact integer sums, times the row's and
    the channel's scales; with ``activation_terms`` 2, plus the same of x's rounding error.
    ``int_mm`` (q [M, K] int8, w [K, N] int8) -> int32 sums, default exact in int64.
    [M, K] float32 -> [M, N] float32."""
    weight = untile(packed).data.t()
    out, x = None, x.float()
    for _ in range(packed.activation_terms):
        q, scale = quantize_rows_int8(x)
        sums = int_mm(q, weight) if int_mm is not None else q.long() @ weight.long()
        term = sums.float() * scale * packed.scales
        out = term if out is None else out + term
        x = x - q.float() * scale
    return out if bias is None else out + bias
