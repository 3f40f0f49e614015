"""The loader's two calls for ``--quantization``: where packed weights come from, and int8 after loading."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from services.worker.quant.gguf_weights import read_gguf
from services.worker.quant.install import install_int8

QUANTIZATIONS = ("none", "int8", "gguf")


def quantized_weights(source, args, quantization: str) -> Iterator[tuple[str, object]] | None:
    """``gguf``: the file's tensors with its q8_0/q4_0/q4_1 blocks as stored; otherwise None (the usual reader)."""
    if quantization != "gguf":
        return None
    if source.format != "gguf":
        raise ValueError(f"--quantization gguf keeps a GGUF file's blocks, but {source.path!r} is not a GGUF file")
    return read_gguf(source.path, args.num_heads, args.num_kv_heads)


def quantize_loaded(model: nn.Module, quantization: str) -> None:
    """``int8``: every matmul weight and the embedding table to int8 with per-channel scales."""
    if quantization != "int8":
        return
    from services.worker.layers.linear import Embedding, Linear

    modules = [m for m in model.modules() if isinstance(m, Linear | Embedding)]
    install_int8(model, modules)
    # On the int8 GEMM (matmul.INT8_GEMM_ROWS) every activation row takes a second int8 term for its rounding error:
    # with one scale per row the inputs' outlier channels cost top-1 agreement with float32. No single projection
    # accounts for it: a second term on the down projection alone recovers little, on all of them most of the gap
    # to the native kernel, whose blocks of 32 share a scale among fewer channels.
    for module in modules:
        module.packed.activation_terms = 2
