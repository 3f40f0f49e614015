"""Linear and embedding layers every model family builds on: half-precision upcast, packed GEMMs, quantized weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.cpu_kernels.mkl_gemm import PackedGemm
from services.worker.cpu_kernels.onednn_gemm import OnednnGemm
from services.worker.cpu_kernels.tile_gemm import TileGemm
from services.worker.quant.formats import PackedWeight
from services.worker.quant.matmul import packed_embedding, packed_linear


class Linear(nn.Linear):
    """``nn.Linear`` that can multiply half-precision weights in float32 (``upcast``).

    On CPUs without bfloat16/float16 units (no AVX512-BF16 or AMX) the half-precision GEMM is
    emulated and runs many times slower than float32 once there is more than one row. Upcasting gives
    the same products (each half-precision value is exact in float32, the GEMM accumulates in
    float32 either way) rounded once to the output dtype; weights and the KV cache stay in half
    precision. A single row (one decode at batch 1) is memory-bound and stays native.
    ``weight_f32`` is a float32 copy made once (see ``LlamaForCausalLM.set_upcast_matmuls``); without
    it the weight is converted on every call, which costs more than the product at small batches.
    """

    upcast: bool = False
    weight_f32: torch.Tensor | None = None
    packed: PackedWeight | None = None  # --quantization: the weight as int8 or GGUF blocks (see quant/)
    gemm: PackedGemm | OnednnGemm | TileGemm | None = None  # the weight packed once for its GEMM (set_packed_gemms)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        if self.gemm is not None and x.shape[0] >= self.gemm.min_rows:
            return self.gemm(x.to(self.gemm.dtype), self.bias).to(x.dtype)
        if self.upcast and x.shape[0] > 1:
            weight = self.weight.float() if self.weight_f32 is None else self.weight_f32
            return upcast_linear(x, weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def upcast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be packed (``--quantization``); rows are dequantized on lookup."""

    packed: PackedWeight | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_embedding(self.packed, ids, self.weight.dtype)
        return F.embedding(ids, self.weight)
