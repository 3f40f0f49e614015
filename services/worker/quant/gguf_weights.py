"""A GGUF file's tensors under Hugging Face names, q8_0 / q4_0 / q4_1 / q5_0 and K-quant (q4_k / q5_k / q6_k)
matrices kept as stored.

Only the ``gguf`` package reads the file (transformers' GGUF reader dequantizes everything).
Tensors of other types (float norms, other quantizations) are dequantized by ``gguf`` itself
and loaded as float tensors. llama.cpp's converter permutes the rows of q and k of the "llama"
architecture for its rotary layout; that permutation moves whole rows, so it is undone on the
packed rows exactly as transformers undoes it on float ones (``gguf_names.PERMUTED_ARCHS``).

Names come from ``gguf_names``. Experts, stored as one [E, N, K] tensor per projection, are always dequantized
(the mixture-of-experts layer computes in float); with ``dequantize`` every tensor is, which is how kvgrid reads
the GGUF files of the architectures transformers' reader does not cover (``setup.gguf_config``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from services.worker.quant.formats import PackedWeight
from services.worker.quant.gguf_names import PERMUTED_ARCHS, expert_names, hf_name

_KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q5_0": "q5_0", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k"}


def unpermute_rows(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (transformers' _reverse_permute_weights)."""
    dim = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, dim, 2).transpose(1, 2).reshape(-1)


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    return "llama" if field is None else bytes(field.parts[field.data[0]]).decode()


def read_gguf(
    path: str, num_heads: int, num_kv_heads: int, dequantize: bool = False
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """(Hugging Face name, float tensor or PackedWeight) for every tensor kvgrid loads; with ``dequantize``,
    float tensors only. Experts (3-D stacks) always come out as float tensors, one per expert."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = gguf_architecture(reader)
    permuted = arch in PERMUTED_ARCHS
    for tensor in reader.tensors:
        experts = expert_names(tensor.name, int(tensor.shape[-1])) if len(tensor.shape) == 3 else None
        if experts is not None:
            stack = gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # [E, N, K]
            for name, one in zip(experts, stack, strict=True):
                yield name, torch.from_numpy(np.array(one, dtype=np.float32, copy=True))
            continue
        name = hf_name(tensor.name, arch)
        if name is None:
            continue
        kind = tensor.tensor_type.name
        fmt = None if dequantize else _KEPT.get(kind)
        if fmt is not None and len(tensor.shape) == 2:
            rows, cols = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF lists dims innermost first
            value = PackedWeight(fmt, torch.from_numpy(np.array(tensor.data, copy=True)).view(rows, -1), cols)
        else:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            value = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
            if arch == "gemma3" and name.endswith("norm.weight"):
                value -= 1  # llama.cpp stores Gemma's 1 + w; the model's RMSNorm adds the 1 (as transformers reads it)
        heads = num_heads if ".q_proj." in name else num_kv_heads if ".k_proj." in name else 0
        if permuted and heads:
            order = unpermute_rows(value.shape[0], heads)
            value = value.rows(order) if isinstance(value, PackedWeight) else value[order].contiguous()
        yield name, value
