"""Tensor-parallel sharding of the Llama family (Megatron style) over ``size`` ranks.

Column-parallel: q/k/v and gate/up; rank r keeps its contiguous share of the output rows, i.e.
query heads [r*H/n, (r+1)*H/n), KV heads [r*KV/n, (r+1)*KV/n) (the same GQA groups, since H/KV
is unchanged) and intermediate columns [r*I/n, (r+1)*I/n). Row-parallel: o_proj and down_proj
keep the matching input columns; each rank's product is a partial sum over its heads or
columns, and one all-reduce per projection gives every rank the full output. Their bias is
added once: rank 0 keeps it, the others get zeros. Embeddings, norms and the logits head are
replicated. A rank's model is the unsharded model built from ``shard_args`` (H/n heads,
KV/n KV heads, I/n intermediate), so its KV cache holds only its own KV heads.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator

import torch

from services.worker.models.llama import LlamaArgs, LlamaForCausalLM

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split dim 0 (outputs)
ROW_PARALLEL = ("o_proj", "down_proj")  # split dim 1 (inputs), all-reduce after


def divisible_sizes(args: LlamaArgs) -> list[int]:
    """Tensor-parallel sizes that divide the query heads, the KV heads and the MLP width."""
    g = math.gcd(args.num_heads, args.num_kv_heads, args.intermediate_size)
    return [n for n in range(1, g + 1) if g % n == 0]


def check_size(args: LlamaArgs, size: int) -> None:
    """Raises ValueError with a one-line reason when ``size`` ranks cannot split this model evenly."""
    if getattr(args, "num_experts", 0):
        raise ValueError(f"--tensor-parallel-size {size}: mixture-of-experts models run on one rank")
    if size in divisible_sizes(args):
        return
    raise ValueError(
        f"--tensor-parallel-size {size} must divide the model's {args.num_heads} attention heads,"
        f" {args.num_kv_heads} KV heads and {args.intermediate_size} MLP width"
        f" (sizes that do: {', '.join(map(str, divisible_sizes(args)))})"
    )


def shard_args(args: LlamaArgs, size: int) -> LlamaArgs:
    """The shapes one rank holds."""
    return dataclasses.replace(
        args,
        num_heads=args.num_heads // size,
        num_kv_heads=args.num_kv_heads // size,
        intermediate_size=args.intermediate_size // size,
    )


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], rank: int, size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors (Hugging Face names) cut to rank ``rank``'s share; others pass unchanged."""
    for name, tensor in weights:
        parts = name.split(".")
        part, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
        if part in COLUMN_PARALLEL:
            yield name, tensor.chunk(size, dim=0)[rank]
        elif part in ROW_PARALLEL and kind == "weight":
            yield name, tensor.chunk(size, dim=1)[rank]
        elif part in ROW_PARALLEL:  # the bias: added once, after the all-reduce sums the ranks
            yield name, tensor if rank == 0 else torch.zeros_like(tensor)
        else:
            yield name, tensor


def attach_all_reduce(model: LlamaForCausalLM, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every row-parallel projection's output goes through ``all_reduce`` (sum over ranks, in place)."""
    for layer in model.layers:
        layer.self_attn.all_reduce = all_reduce
        layer.mlp.all_reduce = all_reduce
