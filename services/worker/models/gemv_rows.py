"""Up to how many rows an unquantized product on the native CPU path takes the native GEMV rather than a GEMM.

The GEMV reads each weight from memory once per step for all its rows (the other rows find it in L1), so it
leads while a step is bound by reading the weights; as rows grow the multiply-adds dominate and a blocked GEMM
overtakes it. Where it crosses depends on the GEMM the weight has (``Linear.gemm``, packed at load: MKL's for
float32, oneDNN's or the AMX tile GEMM for bfloat16, or none) and on whether the GEMV multiplies bfloat16
pairs. ``benchmarks/worker_bench.py`` measures where: whole decode steps by ``--batch-sizes``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.cpu_kernels.library import linear_path, tile_path
from services.worker.cpu_kernels.tile_gemm import TileGemm
from services.worker.setup.cpu_features import detect as detect_cpu

# Float weights without a packed GEMM, against torch's GEMM (bfloat16 weights cross sooner than float32 ones):
# --cpu-kernels native against torch.
NATIVE_ROWS = 16
# bfloat16 on a CPU with bfloat16 dot products (AVX512-BF16, AMX), where torch's GEMM (oneDNN) uses them and the GEMV
# (which widens to float32) does not, so the GEMM overtakes the GEMV within a few rows. The count follows the layers'
# products, most of a step (the LM head's wide product alone crosses sooner); the same benchmark with --dtype bfloat16
# measures it on such a CPU.
# Only where torch cannot reorder the weights for oneDNN (cpu_kernels.onednn_gemm), which then takes every row count.
BF16_UNITS_NATIVE_ROWS = 4
# bfloat16 weights with a reordered oneDNN GEMM, on a CPU whose GEMV multiplies bfloat16 pairs (LINEAR_PATHS'
# "avx512-bf16"): rows up to which that GEMV leads. Measured with benchmarks/worker_bench.py --dtype bfloat16 on
# an AMX Xeon, 2 threads, whole decode steps: 1.49x the GEMM at 1 row, 1.41x at 2, 1.12x at 4, 0.83x at 8.
BF16_PAIR_ROWS = 4
# The same GEMV against the AMX tile GEMM (cpu_kernels.tile_gemm), same benchmark and machine, in decode steps/s:
# 1.06x the tiles at 1 row, 0.92x at 2, 0.79x at 3, 0.8x at 4: the tiles multiply 16 rows for the price of one.
BF16_TILE_PAIR_ROWS = 1
# Against the tile GEMM's AVX512-BF16 kernel (no AMX): SmolLM2 decode steps (100-token contexts), 2 threads, Zen 5,
# alternated in one process: 0.73-0.75x the tiles' steps/s at 1 row (the tiles stream two groups of 32 columns at
# once where the GEMV reads four rows of K), so the tiles take every row count there.
BF16_DOT_TILE_PAIR_ROWS = 0


def gemv_rows(dtype: torch.dtype, bf16_units: bool) -> int:
    """Rows up to which float weights without a packed GEMM take the native GEMV (above: torch's GEMM)."""
    return BF16_UNITS_NATIVE_ROWS if dtype == torch.bfloat16 and bf16_units else NATIVE_ROWS


@dataclass(frozen=True, slots=True)
class GemvRows:
    """The GEMV's row limits for a model's dtype on this CPU: without a packed GEMM (``native``), and where it
    multiplies bfloat16 pairs, ahead of oneDNN's GEMM (``pairs``) and of the tile GEMM (``tile_pairs``, by its
    kernel)."""

    native: int
    pairs: int = 0
    tile_pairs: int = 0

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> GemvRows:
        pairs = dtype == torch.bfloat16 and linear_path() == "avx512-bf16"
        native = gemv_rows(dtype, detect_cpu().bf16_units)
        if not pairs:
            return cls(native)
        return cls(native, BF16_PAIR_ROWS, BF16_TILE_PAIR_ROWS if tile_path() == "amx" else BF16_DOT_TILE_PAIR_ROWS)

    def ahead_of(self, gemm) -> int:
        """Rows the pair GEMV takes ahead of a packed GEMM (0 unless the GEMM is bfloat16)."""
        if gemm.dtype != torch.bfloat16:
            return 0
        return self.tile_pairs if isinstance(gemm, TileGemm) else self.pairs

    def takes_gemv(self, gemm, rows: int) -> bool:
        """Whether a product of ``rows`` rows on a weight with this packed GEMM (or None) takes the GEMV: below the
        GEMM's own row minimum or up to ``ahead_of`` it, or up to ``native`` without one."""
        if gemm is None:
            return rows <= self.native
        return rows < gemm.min_rows or rows <= self.ahead_of(gemm)

    def describe(self, gemm) -> str:
        """Which kernels the products on a weight with this packed GEMM (or None) take by row count, for the log."""
        if gemm is None:
            return f"the native GEMV up to {self.native} rows, torch's GEMM above"
        if pairs := self.ahead_of(gemm):
            rows = "at 1 row" if pairs == 1 else f"up to {pairs} rows"
            return f"the native GEMV on bfloat16 pairs {rows}, the GEMM on {gemm.weights} weights above"
        if gemm.min_rows == 1:
            return f"the GEMM on {gemm.weights} weights at every row count"
        return f"the native GEMV at 1 row, the GEMM on {gemm.weights} weights above"  # from 2 rows
