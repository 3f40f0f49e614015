"""Putting packed weights into a loaded model: GGUF blocks as read, or int8 made from float weights.

A module with a packed weight (``Linear``, ``Embedding`` of ``models.llama``) keeps it in
``module.packed`` (in the layout its products read, ``matmul.kernel_layout``) and gives up its float weight
(an empty tensor of the model dtype is left in its place, so dtype and device still read from it):
the float copy is never held.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from services.worker.quant.formats import (
    PackedParts,
    PackedWeight,
    concat_rows,
    dequantize,
    q5_0_as_q8_0,
    quantize_int8,
)
from services.worker.quant.matmul import kernel_layout, with_amx_copy

log = logging.getLogger(__name__)


def packed_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "packed", None) is not None]


def packed_bytes(model: nn.Module) -> int:
    return sum(m.packed.nbytes for m in packed_modules(model))


def _give_up_float_weight(module: nn.Module, packed: PackedWeight | PackedParts) -> None:
    weight = module.weight
    module.packed = kernel_layout(packed)  # the layout its products read
    module.weight = nn.Parameter(torch.empty(0, dtype=weight.dtype, device=weight.device), requires_grad=False)


def install_gguf(model: nn.Module, parts: dict[str, list[tuple[int, PackedWeight]]]) -> None:
    """Packed checkpoint pieces by parameter name (fused ones by row offset) into their modules.

    A fused weight whose pieces differ in format (a GGUF may store v in another type than q) keeps its
    pieces as ``PackedParts``, runs of one format joined, except that q5_0 pieces beside q8_0 ones become
    q8_0 (the same values and products), so that the fused matrix stays one, which a decode step's one
    native call takes (``llama_one_call``); one whose pieces do not cover it is dequantized into the float
    parameter instead, and the log says so."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    for name, pieces in parts.items():
        pieces.sort(key=lambda piece: piece[0])
        param = params[name]
        rows = sum(p.shape[0] for _, p in pieces)
        if rows == param.shape[0]:
            if {p.format for _, p in pieces} == {"q5_0", "q8_0"}:
                pieces = [(at, q5_0_as_q8_0(p) if p.format == "q5_0" else p) for at, p in pieces]
            runs: list[list[PackedWeight]] = []  # neighbouring pieces of one format
            for _, piece in pieces:
                if runs and runs[-1][0].format == piece.format:
                    runs[-1].append(piece)
                else:
                    runs.append([piece])
            joined = [concat_rows(run) for run in runs]
            _give_up_float_weight(
                modules[name.removesuffix(".weight")], joined[0] if len(joined) == 1 else PackedParts(joined)
            )
            continue
        formats = sorted({p.format for _, p in pieces})
        log.info("%s: pieces in %s do not cover it and are dequantized", name, formats)
        with torch.no_grad():
            for offset, piece in pieces:
                param[offset : offset + piece.shape[0]].copy_(dequantize(piece))


def install_int8(model: nn.Module, targets: list[nn.Module]) -> None:
    """Weight-only int8, one scale per output channel, for each module of ``targets``."""
    for module in targets:
        _give_up_float_weight(module, quantize_int8(module.weight))


def add_amx_copies(model: nn.Module, logits: nn.Module, limit: int, dtype: torch.dtype) -> None:
    """bfloat16 copies of the packed products' weights for the AMX tile GEMM (``matmul.with_amx_copy``; nothing
    where the CPU has no AMX-BF16, or for a model of another ``dtype``, whose activations the GEMM does not
    take): decode batches of 7+ rows are compute-bound on the integer kernel, several times slower. Every
    product's where the copies come to at most ``limit`` bytes, else the LM head's (``logits``, the widest
    product) alone if it fits."""
    if dtype != torch.bfloat16:
        return
    targets = [m for m in packed_modules(model) if m is not logits and isinstance(m, nn.Linear)]
    if getattr(logits, "packed", None) is not None:
        targets.insert(0, logits)
    sizes = [2 * math.prod(m.packed.shape) for m in targets]
    if sum(sizes) > limit:
        targets = targets[:1] if targets and targets[0] is logits and sizes[0] <= limit else []
    for module in targets:
        module.packed = with_amx_copy(module.packed)
