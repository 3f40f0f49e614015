"""Products with packed weights: the native quantized linear, or torch over weights dequantized per call.

``quant_kernels.c`` does y = x W^T with integer dot products over the packed bytes in their tiled
layout (``formats.tile``: models tile their weights once at load; an untiled weight is tiled per
call here). Steps of at least
``DEQUANTIZE_ROWS`` rows (long prefill chunks) are compute-bound instead: there the weight is
dequantized to float32 for the call (cheap next to the GEMM) and torch's GEMM does the product.
Without the native library (no C compiler) every product takes that second way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cpu_kernels.library import DTYPE_CODES, NativeKernelsUnavailable, load_quant
from .formats import FORMAT_CODES, PackedWeight, dequantize, tile

# Rows from which a float32 GEMM over a per-call dequantized copy beats the integer kernel. Whole
# int8 decode steps on 2 cores (tiled kernel): native 1.6x faster at 64 rows and faster at 96, the
# dequantized GEMM 2-3x faster at 128.
DEQUANTIZE_ROWS = 100


def _native():
    try:
        return load_quant()
    except NativeKernelsUnavailable:
        return None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def dequantize_rows(packed: PackedWeight, index: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 rows ``index`` (all when None) of the packed matrix: [len(index), K]."""
    lib = _native()
    if lib is None:
        full = dequantize(packed)
        return full if index is None else full[index]
    packed = tile(packed)
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
    packed: PackedWeight,
    bias: torch.Tensor | None,
    out: torch.Tensor,  # [M, >= N] of x's dtype, rows of any stride
    accumulate: bool = False,
) -> None:
    """out[:, :N] (+)= x W^T + bias, on the native kernel (decode steps take this directly)."""
    lib = load_quant()
    packed = tile(packed)
    n, k = packed.shape
    lib.kvq_set_num_threads(torch.get_num_threads())
    lib.kvq_linear(
        x.data_ptr(), packed.data.data_ptr(), _ptr(packed.scales), _ptr(bias), out.data_ptr(), out.stride(0),
        x.shape[0], n, k, FORMAT_CODES[packed.format], DTYPE_CODES[str(x.dtype).removeprefix("torch.")],
        int(accumulate),
    )  # fmt: skip


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias in x's dtype, for any number of rows: [M, K] -> [M, N]."""
    native = _native() is not None and x.dtype in (torch.float32, torch.bfloat16)
    if native and x.shape[0] < DEQUANTIZE_ROWS:
        out = torch.empty(x.shape[0], packed.shape[0], dtype=x.dtype)
        linear_into(x.contiguous(), packed, bias, out)
        return out
    weight = dequantize_rows(packed)
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)


def packed_embedding(packed: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``ids`` of a packed embedding table: [T] -> [T, E] in ``dtype``."""
    return dequantize_rows(packed, ids).to(dtype)
