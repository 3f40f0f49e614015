"""A PEFT LoRA checkpoint (``adapter_config.json`` + ``adapter_model.safetensors``) as per-layer fused factors.

The model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (see models/llama.py), so an adapter's
factors are fused the same way: for a projection of slices (q, k, v), A stacks each slice's A (padded with zero rows
to the rank ``R``) into ``[slices * R, in]`` and B places each slice's B (scaling folded in) block-diagonally into
``[out, slices * R]``. Then ``x @ A.T @ B.T`` is every slice's ``scale * B_i (A_i x)`` side by side, and the zero
padding adds exact zeros, so adapters of any rank up to ``R`` share one shape.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from services.common.lora_adapters import SUPPORTED_TARGETS, WEIGHTS_FILE, LoraError, check_rank, read_config

# Our fused projection -> (its module in the checkpoint, the checkpoint's slices in row order).
PROJECTIONS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


@dataclass(slots=True, frozen=True)
class ProjectionShape:
    """One fused projection of the base model: input width and each slice's output width."""

    in_features: int
    slice_sizes: tuple[int, ...]


@dataclass(slots=True)
class LoraAdapter:
    name: str
    rank: int  # the largest rank of its modules (before padding)
    # (layer, projection) -> (A [slices * R, in], B [out, slices * R]); projections it does not target are absent.
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def model_projections(hidden: int, intermediate: int, q: int, kv: int) -> dict[str, ProjectionShape]:
    """The fused projections of a Llama-family layer (q = heads * head_dim, kv = kv_heads * head_dim)."""
    return {
        "qkv_proj": ProjectionShape(hidden, (q, kv, kv)),
        "o_proj": ProjectionShape(q, (hidden,)),
        "gate_up_proj": ProjectionShape(hidden, (intermediate, intermediate)),
        "down_proj": ProjectionShape(intermediate, (hidden,)),
    }


def module_scaling(config: dict, module_key: str, rank: int) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rslora; per-module alpha from ``alpha_pattern``."""
    alpha = float(config.get("lora_alpha", 8))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module_key.endswith(pattern):
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_adapter(
    name: str,
    path: str,
    projections: dict[str, ProjectionShape],
    num_layers: int,
    max_rank: int,
    dtype: torch.dtype,
) -> LoraAdapter:
    """Read and fuse an adapter on the host; raises LoraError for anything it cannot serve."""
    from safetensors.torch import load_file

    config = read_config(path)
    check_rank(config, max_rank, path)
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        parts = key.split(".")
        if "layers" not in parts or parts[-2] not in ("lora_A", "lora_B"):
            raise LoraError(f"{path!r}: tensor {key!r} is not a LoRA factor of a decoder layer")
        layer = int(parts[parts.index("layers") + 1])
        module = parts[-3]
        if module not in SUPPORTED_TARGETS or layer >= num_layers:
            raise LoraError(f"{path!r}: tensor {key!r} targets no projection of this model")
        factors.setdefault((layer, module), {})[parts[-2]] = tensor
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top_rank = 0
    for proj, (_, slices) in PROJECTIONS.items():
        shape = projections[proj]
        for layer in range(num_layers):
            present = [s for s in slices if (layer, s) in factors]
            if not present:
                continue
            a = torch.zeros(len(slices) * max_rank, shape.in_features, dtype=torch.float32)
            b = torch.zeros(sum(shape.slice_sizes), len(slices) * max_rank, dtype=torch.float32)
            row = 0
            for i, (s, out) in enumerate(zip(slices, shape.slice_sizes, strict=True)):
                pair = factors.get((layer, s))
                if pair is not None:
                    if set(pair) != {"lora_A", "lora_B"}:
                        raise LoraError(f"{path!r}: layer {layer} {s} lacks lora_A or lora_B")
                    la, lb = pair["lora_A"].float(), pair["lora_B"].float()
                    rank = la.shape[0]
                    if rank > max_rank:
                        raise LoraError(f"{path!r} has rank {rank}, over --max-lora-rank {max_rank}")
                    if la.shape != (rank, shape.in_features) or lb.shape != (out, rank):
                        raise LoraError(
                            f"{path!r}: layer {layer} {s} has factors {tuple(la.shape)} and {tuple(lb.shape)},"
                            f" expected ({rank}, {shape.in_features}) and ({out}, {rank})"
                        )
                    top_rank = max(top_rank, rank)
                    scale = module_scaling(config, f"layers.{layer}.{s}", rank)
                    a[i * max_rank : i * max_rank + rank] = la
                    b[row : row + out, i * max_rank : i * max_rank + rank] = lb * scale
                row += out
            weights[(layer, proj)] = (a.to(dtype), b.to(dtype))
    if not weights:
        raise LoraError(f"{path!r} holds no LoRA factors")
    return LoraAdapter(name, top_rank, weights)
