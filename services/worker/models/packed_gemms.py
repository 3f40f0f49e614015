"""A Llama model's matmul weights packed once at load for the GEMM that multiplies them fastest here.

float32 weights (or ``set_upcast_matmuls``' float32 copies, which the packed ones replace) go to MKL's packed GEMM
(``cpu_kernels.mkl_gemm``), taking products of 2+ rows; bfloat16 ones, on a CPU with bfloat16 units, to oneDNN's
GEMM on weights reordered for it (``cpu_kernels.onednn_gemm``), taking every product; where a tile kernel runs
(AMX-BF16, or AVX512-BF16 dot products), the shape takes the tiles and both copies fit the limit, products of up
to ``tile_gemm.MAX_ROWS`` rows take the tile GEMM instead (``cpu_kernels.tile_gemm``). Packed weights live beside
the model's own: the limit bounds what packing adds resident.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from services.worker.cpu_kernels import mkl_gemm, onednn_gemm, tile_gemm
from services.worker.cpu_kernels.mkl_gemm import PackedGemm
from services.worker.cpu_kernels.onednn_gemm import OnednnGemm
from services.worker.cpu_kernels.tile_gemm import TileGemm
from services.worker.layers.linear import Embedding, Linear

if TYPE_CHECKING:
    from services.worker.models.llama import LlamaForCausalLM

PACKED_GEMM_LIMIT = 2**31  # bytes packing adds resident (a copy per packed weight; AMX tiles: two)
Gemm = PackedGemm | OnednnGemm | TileGemm


def pack(model: LlamaForCausalLM, limit: int = PACKED_GEMM_LIMIT, bf16_units: bool = False) -> str:
    """Sets ``Linear.gemm`` and ``model.logits_gemm`` where torch has the GEMM and the weights come to at most
    ``limit`` bytes. Call after ``set_upcast_matmuls``; returns what it did, for the log."""

    def source(module: Linear | Embedding, copy: torch.Tensor | None) -> torch.Tensor | None:
        weight = module.weight if copy is None else copy
        reorder = weight.dtype == torch.bfloat16 and bf16_units and not model.upcast_matmuls
        return weight if module.packed is None and (weight.dtype == torch.float32 or reorder) else None

    if model.embed_tokens.weight.device.type != "cpu":
        return "the weights are not on the CPU"
    logits = model.logits_module
    linears = {m: source(m, m.weight_f32) for m in model.modules() if isinstance(m, Linear)}
    linears = {m: w for m, w in linears.items() if w is not None}
    logits_source = None if logits in linears else source(logits, model.logits_weight_f32)
    sources = [*linears.values(), *([] if logits_source is None else [logits_source])]
    if not sources:
        return "no float32 weights (nor bfloat16 ones with bfloat16 units) to pack"
    gemm, available = (PackedGemm, mkl_gemm.available) if sources[0].dtype == torch.float32 else (
        OnednnGemm, onednn_gemm.available)  # fmt: skip
    total = sum(w.numel() * w.element_size() for w in sources)
    if not available():
        return f"torch has no GEMM on {gemm.weights} weights here"
    if total > limit:
        return f"{total / 2**20:.0f} MiB of weights is over the {limit / 2**20:.0f} MiB limit"
    tiles = gemm is OnednnGemm and tile_gemm.available() and 2 * total <= limit  # a second copy beside oneDNN's

    def packed(weight: torch.Tensor) -> Gemm:
        return TileGemm(weight) if tiles and tile_gemm.fits(weight) else gemm(weight)

    for module, weight in linears.items():
        module.gemm, module.weight_f32 = packed(weight), None
    model.logits_gemm = logits.gemm if logits in linears else None if logits_source is None else packed(logits_source)
    model.logits_weight_f32 = None
    if model.native_path is not None:
        model.native_path.forget_plans()
    if getattr(model, "decode_call", None) is not None:
        model.decode_call.forget_plans()
    products = "every product" if gemm.min_rows == 1 else f"products of {gemm.min_rows}+ rows"
    on, gemms = f"{gemm.weights} weights", distinct(model)
    if tiled := sum(isinstance(g, TileGemm) for g in gemms):
        on = f"{tile_gemm.describe()} weights" + ("" if tiled == len(gemms) else f" ({tiled} of {len(gemms)}), {on}")
    return f"{products} on {on} (+{sum(g.nbytes for g in gemms) / 2**20:.0f} MiB)"


def distinct(model: LlamaForCausalLM) -> list[Gemm]:
    """The model's packed GEMMs, each once (a tied LM head's is its embedding's)."""
    gemms = [m.gemm for m in model.modules() if isinstance(m, Linear)] + [model.logits_gemm]
    return list({id(g): g for g in gemms if g is not None}.values())
