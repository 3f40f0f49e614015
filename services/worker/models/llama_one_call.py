"""A Llama decode step as one native call (``kvg_decode_layers``, ``cpu_kernels/decode_step.py``): whether every
product of a step takes a kernel that call makes, and the layers described as it reads them.

``NativeCpuPath`` decides once per row count and describes the layers once per set of KV caches; the
description holds addresses (weights, norms, caches) that stay valid while the model keeps its parameters.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch

from services.worker.cpu_kernels import decode_step
from services.worker.cpu_kernels.library import load_quant
from services.worker.cpu_kernels.tile_gemm import TileGemm
from services.worker.quant import matmul
from services.worker.quant.formats import FORMAT_CODES, TILE

if TYPE_CHECKING:
    from services.worker.models.llama_cpu import NativeCpuPath


def all_native(layers: Iterable, takes_gemv: Callable[[object, int], bool], rows: int) -> bool:
    """Whether every product of a decode step of ``rows`` rows takes a kernel that ``kvg_decode_layers`` calls: the
    native GEMV for float weights (``takes_gemv``) or their AMX tile GEMM (``TileGemm``); for packed ones the AMX
    tile GEMM on their bfloat16 copy, or the quantized kernel on their tiles where ``NativeCpuPath.linear`` takes it
    (no int8 GEMM, no dequantized copy: those only Python calls)."""
    for module in (m for layer in layers for m in products(layer)):
        tiles = isinstance(module.gemm, TileGemm) and module.gemm.takes(rows)
        if module.packed is None and not tiles and not takes_gemv(module.gemm, rows):
            return False
        if module.packed is not None and not _packed_native(module.packed, rows):
            return False
    return True


def _packed_native(packed, rows: int) -> bool:
    """Where ``NativeCpuPath.linear`` takes, for a packed weight, a kernel that the one call makes too: the
    quantized kernel on its tiles, or from ``AMX_ROWS`` rows the AMX tile GEMM on its copy."""
    if not packed.tiled or matmul.takes_int8_gemm(packed, rows):  # (parts are never tiled)
        return False
    amx = packed.amx is not None and matmul.AMX_ROWS is not None and rows >= matmul.AMX_ROWS
    return amx or rows < matmul.DEQUANTIZE_ROWS


def describe(
    path: NativeCpuPath, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[decode_step.StepModel, ctypes.Array]:
    """The layers' weights, norms and caches as ``kvg_decode_layers`` reads them; the array of layers too (the
    model points into it: keep both)."""
    layers = (decode_step.StepLayer * len(kv_caches))()
    for step_layer, layer, (k_cache, v_cache) in zip(layers, path.model.layers, kv_caches, strict=True):
        step_layer.input_norm = layer.input_layernorm.weight.data_ptr()
        step_layer.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        step_layer.qkv, step_layer.o, step_layer.gate_up, step_layer.down = map(_step_linear, products(layer))
        step_layer.k_cache, step_layer.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
        step_layer.window = layer.self_attn.window
    formats = [linear.format for layer in layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    packed = any(f != decode_step.FLOAT_WEIGHT for f in formats)
    quant = load_quant() if packed else None
    team = packed and all(f != decode_step.FLOAT_WEIGHT and quant.kvq_takes_tiles(f) for f in formats)
    program = decode_step.StepModel(
        num_layers=len(kv_caches), heads=path.heads, kv_heads=path.kv_heads, head_dim=path.head_dim,
        block_size=kv_caches[0][0].shape[1], dt=path.code, hidden=path.hidden, intermediate=path.intermediate,
        eps=path.eps, scale=path.scale, cos=path.model.cos.data_ptr(), sin=path.model.sin.data_ptr(),
        quant_linear=decode_step.address(quant.kvq_linear) if packed else None,
        quant_tiles=decode_step.address(quant.kvq_linear_tiles) if packed else None,
        team=int(team), gemv_rows=path.rows.tile_pairs, quant_tile_rows=_quant_tile_rows(), layers=layers,
    )  # fmt: skip
    return program, layers


def _quant_tile_rows() -> int:
    """``StepModel.quant_tile_rows``: ``AMX_ROWS``, or a count no step reaches where there is none."""
    return matmul.AMX_ROWS if matmul.AMX_ROWS is not None else 2**31 - 1


def products(layer) -> tuple:
    """A layer's four products, in step order: qkv, o, gate_up, down."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _step_linear(module) -> decode_step.StepLinear:
    """One product as ``kvg_decode_layers`` calls it: a float weight on the GEMV, or on its AMX tiles above the GEMV's
    rows; a packed one on the quantized kernel, or on its AMX copy from ``AMX_ROWS`` rows."""
    bias = _address(getattr(module, "bias", None))
    packed = module.packed
    if packed is None:
        n, k = module.weight.shape
        amx = module.gemm.tiles.data_ptr() if isinstance(module.gemm, TileGemm) else None
        return decode_step.StepLinear(module.weight.data_ptr(), None, bias, n, k, decode_step.FLOAT_WEIGHT, 0, amx)
    n, k = packed.shape
    tiles = -(-n // TILE)
    if packed.data.nbytes % tiles:
        raise ValueError(
            f"a tiled {packed.format} weight of {n} rows holds {packed.data.nbytes} bytes, not whole tiles"
        )
    return decode_step.StepLinear(
        packed.data.data_ptr(), _address(packed.scales), bias, n, k, FORMAT_CODES[packed.format],
        packed.data.nbytes // tiles, _address(packed.amx),
    )  # fmt: skip


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
