"""Phi-3: the Llama layer, its checkpoint storing q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj``.

kvgrid fuses the same way (q, k, v rows in that order; gate rows then up rows), so the loader splits the fused
tensors into the Llama names here (before tensor-parallel sharding, which cuts q, k and v apart) and
``LlamaForCausalLM.load_weights`` puts them back together; the model itself, the native CPU path included, is the
Llama one. A GGUF file keeps the same fused tensors (``attn_qkv``, gate-then-up ``ffn_up``); their packed
blocks split by rows like float tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from services.worker.models.llama import LlamaArgs
from services.worker.quant.formats import PackedWeight

ARCHITECTURES = ("Phi3ForCausalLM",)


def check_phi3(cfg) -> None:
    """Raises ValueError for the Phi-3 variants kvgrid does not compute (partial rotary embeddings)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if factor not in (None, 1.0):
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor {factor}) are not supported")


def split_fused(weights: Iterable[tuple[str, torch.Tensor]], args: LlamaArgs) -> Iterator[tuple[str, torch.Tensor]]:
    """Phi-3's ``qkv_proj`` and ``gate_up_proj`` tensors as the Llama family's q/k/v and gate/up ones."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        if prefix.endswith("qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            parts = _split_rows(tensor, [q, kv, kv])
            yield from ((f"{base}{p}.{kind}", t) for p, t in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True))
        elif prefix.endswith("gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            gate, up = _split_rows(tensor, [args.intermediate_size] * 2)
            yield f"{base}gate_proj.{kind}", gate
            yield f"{base}up_proj.{kind}", up
        else:
            yield name, tensor


def _split_rows(tensor: torch.Tensor | PackedWeight, sizes: list[int]) -> list[torch.Tensor | PackedWeight]:
    """Consecutive row ranges of a float tensor or of a packed one (a GGUF's blocks: each row is its own blocks)."""
    if not isinstance(tensor, PackedWeight):
        return list(tensor.split(sizes, dim=0))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [tensor.rows(torch.arange(start, start + size)) for start, size in zip(starts, sizes, strict=True)]
