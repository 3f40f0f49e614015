"""Products with packed weights: an int8 GEMM, the native quantized linear, or torch over weights
dequantized per call.

- int8 weights through oneDNN's int8 GEMM (``torch._int_mm``), from ``INT8_GEMM_ROWS`` rows: each
  row of x is quantized to int8 in two terms (the row with one scale, then what that rounding lost,
  the same way: with one scale per row alone the inputs' outlier channels cost top-1 agreement with
  float32, see ``quant.load``; the second term doubles the GEMM's rows, a real share of a large step
  that this accuracy is worth) and the GEMM multiplies both with the weight as stored, row by row
  ([N, K], read transposed). The int32 sums are scaled by the row's and the channel's scales. Where
  it starts is the CPU's (``CpuFeatures.int8_gemm_rows``): with AMX-INT8 at one row (the AMX tiles
  beat the native kernel on whole decode steps at every batch size), so only the stored rows are
  kept. With AVX-512 VNNI but no AMX the native kernel leads at small batches and the GEMM from
  about 24 rows: models keep both layouts there (the int8 weights twice, as much memory as bfloat16
  weights) and steps of 24 rows or more take the GEMM. On AVX2 alone oneDNN emulates the dot
  products, slower than the native kernel even at batch 1: int8 keeps to the native kernel like the
  GGUF formats. ``benchmarks/worker_bench.py --quantization int8`` times whole int8 decode steps by
  batch size on whichever path the CPU takes.
- ``quant_kernels.c`` does y = x W^T with integer dot products over the packed bytes in their tiled
  layout (``formats.tile``: models tile their weights once at load, ``kernel_layout``; an untiled
  weight is tiled per call here), x quantized per block of 32 as ggml does.
- On a CPU with AMX-BF16 or AVX512-BF16, weights that bfloat16 models give a bfloat16 copy in the tile GEMM's
  layout (``with_amx_copy``, named for the AMX tiles it was first made for; ``cpu_kernels/tile_gemm.py`` multiplies
  it on either) take that GEMM from ``AMX_ROWS`` rows, at any row count above: the integer kernel is
  compute-bound there and the tiles are several times faster. Its numerics are
  the bfloat16 weights' (float32 sums over K in order, rounded to bfloat16 as torch rounds).
- Steps of at least ``DEQUANTIZE_ROWS`` rows (long prefill chunks) are compute-bound: there a
  weight the int8 GEMM does not take is dequantized to float32 for the call (cheap next to the
  GEMM) and torch's GEMM does the product. Without the native library (no C compiler) every product
  of those weights takes that way.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from services.worker.cpu_kernels import library, tile_gemm
from services.worker.cpu_kernels.library import DTYPE_CODES, NativeKernelsUnavailable, load_quant
from services.worker.quant.formats import (
    FORMAT_CODES,
    PackedParts,
    PackedWeight,
    dequantize,
    reference_int8_gemm,
    tile,
    untile,
)
from services.worker.setup.cpu_features import detect

# Rows from which a float32 GEMM over a per-call dequantized copy beats the integer kernel: dequantizing costs the
# same at any row count, so it pays only once the rows are enough for torch's compute-bound GEMM to outrun the integer
# kernel by more than that. benchmarks/quant_bench.py times both per product across --rows.
DEQUANTIZE_ROWS = 100


# Rows from which a weight with a bfloat16 copy (``with_amx_copy``) takes the AMX tile GEMM instead of the integer
# kernel (None: no AMX-BF16 here). Few rows stream the packed bytes, fewer than the copy's; tiles multiply 16 rows
# for the price of one. SmolLM2 Q4_1 decode steps, bfloat16, AMX Xeon, 2 threads (benchmarks/worker_bench.py's
# kvgrid_decode, this limit set for either kernel in turn, medians of 3 rounds), ms: integer 8.7 / 10.8 / 12.6 /
# 14.5 / 15.3 at 4 / 5 / 6 / 7 / 8 rows, tiles 13.2 to 13.9 at all of these; at 64 rows the integer kernel takes
# 2.0x the tiles. Without AMX, the copy on the tile GEMM's AVX512-BF16 kernel: SmolLM2 Q4_1 decode steps (100-token
# contexts, Zen 5, 2 threads, alternated in one process), the integer kernel's time over the tiles': 0.76 at 2 rows,
# 0.94 at 3, 1.03 at 4, 1.25 at 5, 1.38 at 6, 1.32 at 10, 1.94 at 16, 2.0 at 64.
AMX_ROWS = 7 if detect().amx_bf16 else 5 if detect().bf16_units else None

# Rows from which int8 products take the int8 GEMM (None: never), set once per process from the CPU
# (``CpuFeatures.int8_gemm_rows``); tests switch it to run either path on any CPU.
INT8_GEMM_ROWS = detect().int8_gemm_rows


def kernel_layout(packed: PackedWeight | PackedParts) -> PackedWeight | PackedParts:
    """The layout a model keeps for its products: tiled for the native kernel, the rows as stored for
    the int8 GEMM, or both where the GEMM takes only the large steps (each part's, for parts)."""
    if isinstance(packed, PackedParts):
        return PackedParts([kernel_layout(p) for p in packed.parts])
    if packed.format != "int8" or INT8_GEMM_ROWS is None:
        return tile(packed)
    if INT8_GEMM_ROWS <= 1:
        return untile(packed)
    return replace(tile(packed), stored=untile(packed).data)


def with_amx_copy(packed: PackedWeight | PackedParts, chunk: int = 16384) -> PackedWeight | PackedParts:
    """``packed`` with its values also as bfloat16 in the tile GEMM's layout (``tile_gemm.to_tiles``), where this CPU
    runs a tile kernel (AMX-BF16 or AVX512-BF16), the native kernels build and N and K are multiples of 32; otherwise
    as it is (parts: each part's). The copy takes 2 bytes a weight, beside the packed bytes that single rows keep
    reading (``quant.install.add_amx_copies``)."""
    if isinstance(packed, PackedParts):
        return PackedParts([with_amx_copy(p, chunk) for p in packed.parts])
    n, k = packed.shape
    if AMX_ROWS is None or n % tile_gemm.ALIGN or k % tile_gemm.ALIGN or _native() is None:
        return packed
    if not tile_gemm.available():  # (CPUID says AMX or AVX512-BF16, Linux may still refuse AMX's tiles)
        return packed
    tiles = torch.empty(n // 32, k // 32, 16, 32, 2, dtype=torch.bfloat16)
    # float32 a chunk of rows at a time, not the whole matrix (chunk: a multiple of 32, so whole groups of tiles)
    for start in range(0, n, chunk):
        rows = dequantize_rows(packed, torch.arange(start, min(n, start + chunk))).to(torch.bfloat16)
        tiles[start // 32 : start // 32 + rows.shape[0] // 32] = tile_gemm.to_tiles(rows)
    return replace(packed, amx=tiles)


def takes_amx(packed: PackedWeight, x: torch.Tensor) -> bool:
    """Whether ``x``'s rows take the weight's AMX copy: bfloat16 rows, at least ``AMX_ROWS`` of them."""
    return packed.amx is not None and AMX_ROWS is not None and x.shape[0] >= AMX_ROWS and x.dtype == torch.bfloat16


def amx_into(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor, accumulate: bool):
    """out (+)= x W^T + bias on the AMX copy (``takes_amx``); out bfloat16, rows of any stride."""
    n, k = packed.shape
    lib = library.load()
    lib.kvg_set_num_threads(torch.get_num_threads())
    done = lib.kvg_tile_linear(
        x.data_ptr(), x.stride(0), packed.amx.data_ptr(), _ptr(bias), out.data_ptr(), out.stride(0), x.shape[0], n, k,
        int(accumulate),
    )  # fmt: skip
    if not done:
        raise RuntimeError(f"the AMX tile GEMM failed on {x.shape[0]} rows (tiles revoked, or no memory for padding)")


def takes_int8_gemm(packed: PackedWeight, rows: int) -> bool:
    return packed.format == "int8" and INT8_GEMM_ROWS is not None and rows >= INT8_GEMM_ROWS


def int8_gemm_into(
    x: torch.Tensor,  # [M, K] float32 or bfloat16, contiguous
    packed: PackedWeight,  # int8, rows as stored
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, >= N] of x's dtype, rows of any stride
    accumulate: bool = False,
) -> None:
    """out[:, :N] (+)= x W^T + bias for int8 W: x quantized per row (scale max |x| / 127), int32
    sums from oneDNN's int8 GEMM, then both scales; with ``activation_terms`` 2 (as models install
    them) the rounding error of x takes a second pass (``formats.reference_int8_gemm``)."""
    lib = _native()
    if lib is None or x.dtype not in (torch.float32, torch.bfloat16):  # the C ends take these two
        product = reference_int8_gemm(x.float(), packed, None if bias is None else bias.float(), torch._int_mm)
        target = out[:, : product.shape[1]]
        target.add_(product.to(out.dtype)) if accumulate else target.copy_(product)
        return
    m, k = x.shape
    terms = packed.activation_terms
    dtype = DTYPE_CODES[str(x.dtype).removeprefix("torch.")]
    q = torch.empty(terms * m, k, dtype=torch.int8)  # each term's rows under the last: one GEMM for all
    row_scale = torch.empty(terms * m, dtype=torch.float32)
    lib.kvq_set_num_threads(torch.get_num_threads())
    lib.kvq_quantize_rows_int8(x.data_ptr(), m, k, dtype, q.data_ptr(), row_scale.data_ptr())
    if terms == 2:  # what the first term's rounding lost, quantized the same way
        lib.kvq_quantize_residual_int8(
            x.data_ptr(), m, k, dtype, q.data_ptr(), row_scale.data_ptr(), q[m:].data_ptr(), row_scale[m:].data_ptr()
        )
    sums = torch._int_mm(q, untile(packed).data.t())  # weight [K, N]: a view of the rows as stored
    n = sums.shape[1]
    for t in range(terms):
        lib.kvq_scale_int32(
            sums[t * m :].data_ptr(), m, n, row_scale[t * m :].data_ptr(), packed.scales.data_ptr(),
            _ptr(None if t else bias), out.data_ptr(), out.stride(0), dtype, int(accumulate or t > 0),
        )  # fmt: skip


def _native():
    try:
        return load_quant()
    except NativeKernelsUnavailable:
        return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dequantize_rows(packed: PackedWeight | PackedParts, index: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rows ``index`` (all when None) of the packed matrix: [len(index), K]."""
    if isinstance(packed, PackedParts):  # (whole matrices only: parts are never embedding tables)
        return torch.cat([dequantize_rows(p) for p in packed.parts])
    lib = _native()
    if lib is None or not packed.tiled:  # (the native kernel reads the tiled layout)
        return dequantize(packed if index is None else packed.rows(index))
    count = packed.shape[0] if index is None else index.numel()
    index = None if index is None else index.to(torch.int64).contiguous()
    out = torch.empty(count, packed.num_cols, dtype=torch.float32)
    lib.kvq_set_num_threads(torch.get_num_threads())
    lib.kvq_dequantize_rows(
        packed.data.data_ptr(), _ptr(packed.scales), _ptr(index), count, packed.num_cols,
        FORMAT_CODES[packed.format], out.data_ptr(),
    )  # fmt: skip
    return out


def linear_into(
    x: torch.Tensor,  # [M, K] float32 or bfloat16, contiguous
    packed: PackedWeight | PackedParts,
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, >= N] of x's dtype, rows of any stride
    accumulate: bool = False,
) -> None:
    """out[:, :N] (+)= x W^T + bias, on the int8 GEMM or the native kernel (decode steps take this directly);
    parts each into their own columns."""
    if isinstance(packed, PackedParts):
        for start, part in zip(packed.offsets(), packed.parts, strict=True):
            end = start + part.shape[0]
            linear_into(x, part, None if bias is None else bias[start:end], out[:, start:end], accumulate)
        return
    if takes_int8_gemm(packed, x.shape[0]):
        int8_gemm_into(x, packed, bias, out, accumulate)
        return
    if takes_amx(packed, x):
        amx_into(x, packed, bias, out, accumulate)
        return
    lib = load_quant()
    packed = tile(packed)
    n, k = packed.shape
    lib.kvq_set_num_threads(torch.get_num_threads())
    lib.kvq_linear(
        x.data_ptr(), packed.data.data_ptr(), _ptr(packed.scales), _ptr(bias), out.data_ptr(), out.stride(0),
        x.shape[0], n, k, FORMAT_CODES[packed.format], DTYPE_CODES[str(x.dtype).removeprefix("torch.")],
        int(accumulate),
    )  # fmt: skip


def packed_linear(
    x: torch.Tensor, packed: PackedWeight | PackedParts, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T + bias in x's dtype, for any number of rows: [M, K] -> [M, N]."""
    if isinstance(packed, PackedParts):
        ends = [start + p.shape[0] for start, p in zip(packed.offsets(), packed.parts, strict=True)]
        return torch.cat(
            [
                packed_linear(x, part, None if bias is None else bias[start:end])
                for start, end, part in zip(packed.offsets(), ends, packed.parts, strict=True)
            ],
            dim=1,
        )
    if takes_int8_gemm(packed, x.shape[0]):
        out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
        int8_gemm_into(x.contiguous(), packed, bias, out)
        return out
    native = _native() is not None and x.dtype in (torch.float32, torch.bfloat16)
    if native and (x.shape[0] < DEQUANTIZE_ROWS or takes_amx(packed, x)):
        out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
        linear_into(x.contiguous(), packed, bias, out)
        return out
    weight = dequantize_rows(packed)
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def packed_embedding(packed: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a packed embedding table: [T] -> [T, E] in ``dtype``."""
    return dequantize_rows(packed, ids).to(dtype)
