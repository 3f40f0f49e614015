"""The loader's two calls for ``--quantization``: where packed weights come from, and int8 after loading."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from .gguf_weights import read_gguf
from .install import install_int8

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
    from ..models.llama import Embedding, Linear

    install_int8(model, [m for m in model.modules() if isinstance(m, Linear | Embedding)])
    # The down projection's input, silu(gate) * up, has the outlier channels that one int8 scale per
    # row serves worst: on the int8 GEMM it takes a second term (top-1 agreement with float32 on the
    # accuracy test 89% -> 91-93%, for ~6% of a batch-64 step). The native kernel's 32-value blocks need none.
    for layer in model.layers:
        layer.mlp.down_proj.packed.activation_terms = 2
