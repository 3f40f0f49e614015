"""The C structs of ``kvg_decode_layers`` (``decode_layers.h``): a decode-only step's layers in one native call.

A model describes its layers once (weights, norms, caches: addresses that hold while it keeps its parameters and the
worker its caches) as a ``StepModel``; each step passes its buffers and the step's positions, slots, block tables and
sequence lengths. The layout here must match the C structs field for field.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_float, c_int, c_int64, c_void_p

FLOAT_WEIGHT = -1  # StepLinear.format of a float weight (kvg_linear); any other is the quantized kernel's format code


class StepLinear(Structure):
    _fields_ = [
        ("weight", c_void_p),
        ("scales", c_void_p),
        ("bias", c_void_p),
        ("n", c_int64),
        ("k", c_int64),
        ("format", c_int),
        ("tile_bytes", c_int64),
        ("amx", c_void_p),  # the weight's bfloat16 copy in AMX tiles (cpu_kernels.tile_gemm): see StepModel's rows
    ]


class StepLayer(Structure):
    _fields_ = [
        ("input_norm", c_void_p),
        ("post_norm", c_void_p),
        ("qkv", StepLinear),
        ("o", StepLinear),
        ("gate_up", StepLinear),
        ("down", StepLinear),
        ("k_cache", c_void_p),
        ("v_cache", c_void_p),
        ("window", c_int),
        # Gemma 3 (StepModel.gemma): norms' float32 scales (1 + weight; input_norm and post_norm too), rotary tables
        ("pre_ffn_norm", c_void_p),
        ("post_ffn_norm", c_void_p),
        ("q_norm", c_void_p),
        ("k_norm", c_void_p),
        ("cos", c_void_p),
        ("sin", c_void_p),
    ]


class StepModel(Structure):
    _fields_ = [
        ("num_layers", c_int),
        ("heads", c_int),
        ("kv_heads", c_int),
        ("head_dim", c_int),
        ("block_size", c_int),
        ("dt", c_int),
        ("hidden", c_int64),
        ("intermediate", c_int64),
        ("eps", c_float),
        ("scale", c_float),
        ("cos", c_void_p),
        ("sin", c_void_p),
        ("quant_linear", c_void_p),
        ("quant_tiles", c_void_p),
        ("team", c_int),
        ("gemv_rows", c_int),  # a float weight takes its AMX copy above these rows
        ("quant_tile_rows", c_int),  # a packed weight from these rows (quant.matmul.AMX_ROWS)
        ("layers", POINTER(StepLayer)),
        ("gemma", c_int),  # the layers are Gemma 3's
    ]


class StepBuffers(Structure):
    _fields_ = [(name, c_void_p) for name in ("hidden", "normed", "qkv", "attn", "gate_up", "act")]


# model, buffers, rows, positions, slots, block_tables, ldt, seq_lens
SIGNATURE = (POINTER(StepModel), POINTER(StepBuffers), c_int, c_void_p, c_void_p, c_void_p, c_int64, c_void_p)


def address(function) -> int:
    """The address of a ctypes library function, for a struct's function pointer."""
    return ctypes.cast(function, c_void_p).value
