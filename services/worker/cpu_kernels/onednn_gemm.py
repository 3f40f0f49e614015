"""bfloat16 GEMMs on weights reordered once for oneDNN, on CPUs with bfloat16 units.

torch's bfloat16 ``F.linear`` on a CPU is oneDNN's GEMM, which copies the weight into its blocked
bfloat16-pair layout on every call. At the row counts of decode batches that copy is most of the
call. Reordered once at load (``torch.ops.mkldnn._reorder_linear_weight``, the op Inductor's CPU
freezing uses) and multiplied by ``torch.ops.mkldnn._linear_pointwise``, the same GEMM skips that
copy: never slower than ``F.linear``, it gains most at few rows, where the copy is the largest share
of the call, and evens out at prefill sizes, where the product itself dominates. It also matches the
native GEMV at one row and beats it above, because the GEMV widens bfloat16 to float32 while these
units multiply bfloat16 pairs as stored. ``benchmarks/worker_bench.py --dtype bfloat16`` times the
decode steps these products serve. The products are ``F.linear``'s bit for bit (the same kernels, a
layout chosen once). The reordered weight holds the weight once more (~1x its bytes resident).

Only where the CPU has bfloat16 units (AVX512-BF16, AMX): elsewhere oneDNN emulates bfloat16 and
the model multiplies in float32 (``layers.linear.Linear.upcast``).
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Whether this torch reorders and multiplies bfloat16 weights through oneDNN (a private op)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(8, 16, dtype=torch.bfloat16)
        product = OnednnGemm(weight)(torch.ones(2, 16, dtype=torch.bfloat16))
    except (AttributeError, RuntimeError):
        return False
    return bool((product == 16).all())


class OnednnGemm:
    """y = x W^T (+ bias) for a bfloat16 weight [N, K], reordered at construction; W itself is not kept."""

    weights = "oneDNN's reordered bfloat16"  # for the log
    dtype = torch.bfloat16  # of the weight, the input and the product
    min_rows = 1  # at least as fast as the native GEMV at one row too (see above)
    writes_into = False  # returns its own output tensor (the callers use it where it is)

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"the oneDNN GEMM takes a 2-D bfloat16 CPU weight, not {weight.dtype} {weight.dim()}-D")
        self.n, self.k = weight.shape
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
        self.nbytes = weight.numel() * weight.element_size()  # what it holds resident, about

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # [M, K] -> [M, N]
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [None], "")
