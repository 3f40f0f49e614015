"""float32 GEMMs on weights packed once for MKL (``cblas_sgemm_pack`` / ``cblas_sgemm_compute``).

MKL's sgemm copies the weight into its blocked layout on every call. At the row counts of decode
batches that copy is a large share of the call, so a weight packed once beats torch's ``F.linear``
there, by less as the rows grow and the product's own work outweighs the copy
(``benchmarks/worker_bench.py --dtype float32`` times the decode steps these products serve). The packed
layout holds the weight once more (~1x its bytes resident). Products equal ``F.linear``'s within
float32 rounding (bitwise at most shapes: the same kernels over the same blocks; below ~8 rows
F.linear takes another kernel, and MKL may split a call's threads differently).

torch's CPU library exports both functions when it is built with MKL (the x86-64 wheels);
``available`` says whether this one does. torch's own ``_mkl_linear`` takes a packed weight only at
the one row count it was packed for, which rules it out for batches that change every step.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS, _B_MATRIX, _PACKED = 101, 111, 112, 162, 151
_PACK_ROWS_HINT = 64  # the row count MKL is told to expect (the packed size does not depend on it)


@functools.cache
def _mkl() -> ctypes.CDLL | None:
    if not torch.backends.mkl.is_available():
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError):
        return None
    c_int, c_float, ptr = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    get_size.argtypes, get_size.restype = (c_int,) * 4, ctypes.c_size_t
    pack.argtypes, pack.restype = (c_int,) * 6 + (c_float, ptr, c_int, ptr), None
    compute.argtypes = (c_int,) * 6 + (ptr, c_int, ptr, c_int, c_float, ptr, c_int)
    compute.restype = None
    return lib


def available() -> bool:
    """Whether torch's CPU library carries MKL's packed GEMM here."""
    return _mkl() is not None


class PackedGemm:
    """y = x W^T (+ bias) for a float32 weight [N, K], packed at construction; W itself is not kept."""

    weights = "MKL's packed float32"  # for the log
    dtype = torch.float32  # of the weight, the input and the product
    min_rows = 2  # one row reads the weight once either way: the native GEMV or torch's own
    writes_into = True  # computes straight into a given output (rows may be strided)

    def __init__(self, weight: torch.Tensor):
        lib = _mkl()
        if lib is None:
            raise RuntimeError("torch's CPU library has no MKL packed GEMM")
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"MKL's packed GEMM takes a 2-D float32 CPU weight, not {weight.dtype} {weight.dim()}-D")
        self.lib = lib
        self.n, self.k = weight.shape
        weight = weight.contiguous()
        size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS_HINT, self.n, self.k)
        # get_size is an upper bound, a multiple of the weight; the pages MKL never writes stay unallocated.
        self.buffer = torch.empty(-(-size // 4), dtype=torch.float32)
        lib.cblas_sgemm_pack(
            _ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, self.n, self.k, 1.0, weight.data_ptr(), self.k,
            self.buffer.data_ptr(),
        )  # fmt: skip
        self.nbytes = weight.numel() * 4  # what it holds resident, about

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # [M, K] -> [M, N]
        out = torch.empty(x.shape[0], self.n, dtype=torch.float32)
        self.into(x, out, bias)
        return out

    def into(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """out = x W^T (+ bias): x [M, K], out [M, N] float32 with unit column stride (rows may be strided)."""
        x = x.contiguous()
        if out.dtype != torch.float32 or out.shape != (x.shape[0], self.n) or out.stride(1) != 1:
            raise ValueError(f"the output must be a float32 [{x.shape[0]}, {self.n}] matrix with unit column stride")
        if bias is not None:  # as addmm: C starts as the bias, then C += x W^T
            out.copy_(bias.expand_as(out))
        self.lib.cblas_sgemm_compute(
            _ROW_MAJOR, _NO_TRANS, _PACKED, x.shape[0], self.n, self.k, x.data_ptr(), self.k, self.buffer.data_ptr(),
            self.n, 0.0 if bias is None else 1.0, out.data_ptr(), out.stride(0),
        )  # fmt: skip
