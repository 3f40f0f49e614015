"""bfloat16 GEMMs of decode-sized batches on a tiled copy of the weights: AMX tiles (``amx_gemm.h``) or, on CPUs
with AVX512-BF16 and no AMX, the same layout on VDPBF16PS dot products (``tile_gemm_bf16dot.h``); oneDNN's above.

oneDNN's GEMM on weights reordered for it (``onednn_gemm``) returns a fresh tensor, each call through torch costs
~20 us (a SmolLM2 step makes 120), and the one-call decode step (``kvg_decode_layers``) cannot call it.
``kvg_tile_linear`` streams a weight copy in AMX's tile layout, each thread its own run of columns in order, into
the step's buffers, residual adds included; from C the one-call decode step takes it too. With AMX a decode step
of tens of rows is bound by reading the weights, where oneDNN reads them at ~60% of the memory bandwidth at 64
rows; with AVX512-BF16 alone it is bound by the multiply-adds, where the dot-product kernel keeps 24 sums in
registers against one broadcast of x per row and four weight vectors (930-980 GFLOPS on two Zen 5 cores at 64 rows,
oneDNN's 710-940 on the same shapes). Products of more than ``MAX_ROWS`` rows (prefill chunks) keep oneDNN's
GEMM, whose blocking is as fast or faster there. So a weight is held twice more (tiles and oneDNN's copy).
``benchmarks/worker_bench.py --dtype bfloat16`` times the decode steps.

Numerics: float32 sums over the whole of K in order, the bias added, rounded to bfloat16 as torch rounds;
accumulating, rounded and then added, as ``out.add_(product)``. AMX adds 32 products of K a step (tdpbf16ps):
oneDNN's products on 16 rows are these bit for bit. The dot-product kernel adds each pair's odd then even
product, a float32 rounding each (VDPBF16PS): a float32 loop in that order gives its bits. oneDNN splits K into
blocks on more rows, so each differs from it in the last place now and then (bfloat16's contract is the
reference's top 5, DESIGN §2). A row's product does not depend on how many rows share the step.
"""

from __future__ import annotations

import functools

import torch

from services.worker.cpu_kernels import library
from services.worker.cpu_kernels.onednn_gemm import OnednnGemm

# At 512 rows the two are even (2 threads: AMX Xeon; Zen 5 on the dot products, within 1% from 256 to 1024 rows);
# at 2048 oneDNN takes two thirds the AMX tiles' time.
MAX_ROWS = 512
ALIGN = 32  # N and K must be multiples of it (the tile layout's groups and chunks)


@functools.cache
def available() -> bool:
    """Whether a tile kernel runs here: AMX-BF16 tiles that Linux grants this process, or AVX512-BF16 (and the
    native kernels build here)."""
    try:
        return library.tile_path() is not None
    except library.NativeKernelsUnavailable:
        return False


def describe() -> str:
    """The tiled weights as the log names them, by the kernel in use."""
    units = "AMX-tiled" if library.tile_path() == "amx" else "tiled (AVX512-BF16)"
    return f"{units} bfloat16 (oneDNN's reordered above {MAX_ROWS} rows)"


def fits(weight: torch.Tensor) -> bool:
    """Whether a weight's shape takes the tile layout."""
    return weight.dim() == 2 and weight.shape[0] % ALIGN == 0 and weight.shape[1] % ALIGN == 0


def to_tiles(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] as [N / 32, K / 32, 16, 32, 2]: per 32 rows and 32 columns, pairs of columns by row."""
    n, k = weight.shape
    return weight.view(n // 32, 32, k // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


class TileGemm:
    """y = x W^T (+ bias) for a bfloat16 weight [N, K] (N, K multiples of 32): the tile kernel up to MAX_ROWS rows,
    oneDNN's GEMM above."""

    dtype = torch.bfloat16
    min_rows = 1
    writes_into = True  # up to MAX_ROWS rows, into a given output (rows may be strided), adding to it if asked

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.bfloat16 or not fits(weight) or weight.device.type != "cpu":
            raise ValueError(
                f"the tile GEMM takes a bfloat16 CPU weight of whole 32 x 32 blocks, not {weight.dtype}"
                f" {tuple(weight.shape)}"
            )
        self.n, self.k = weight.shape
        self.tiles = to_tiles(weight)
        self.large = OnednnGemm(weight)
        self.nbytes = self.tiles.nbytes + self.large.nbytes
        self.lib = library.load()

    @property
    def weights(self) -> str:  # for the log
        return describe()

    def takes(self, rows: int) -> bool:
        return rows <= MAX_ROWS

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # [..., K] -> [..., N]
        rows = x.reshape(-1, self.k)
        if not self.takes(rows.shape[0]):
            return self.large(x, bias)
        out = torch.empty(rows.shape[0], self.n, dtype=torch.bfloat16)
        self.into(rows.contiguous(), out, bias)
        return out.view(*x.shape[:-1], self.n)

    def into(
        self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None, accumulate: bool = False
    ) -> None:
        """out (+)= x W^T + bias for up to MAX_ROWS rows (above, call ``large``: its own output, no copy); x's and
        out's rows may be strided."""
        rows = x.shape[0]
        if not self.takes(rows):
            raise ValueError(f"the tile GEMM takes up to {MAX_ROWS} rows, not {rows}: oneDNN's (large) above")
        if x.stride(1) != 1 or out.stride(1) != 1 or x.dtype != torch.bfloat16 or out.dtype != torch.bfloat16:
            raise ValueError("the tile GEMM takes bfloat16 rows of contiguous values")
        self.lib.kvg_set_num_threads(torch.get_num_threads())
        done = self.lib.kvg_tile_linear(
            x.data_ptr(), x.stride(0), self.tiles.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), out.stride(0), rows, self.n, self.k, int(accumulate),
        )  # fmt: skip
        if not done:
            raise RuntimeError(f"the tile GEMM failed on {rows} rows (AMX tiles revoked, or no memory for padding)")
