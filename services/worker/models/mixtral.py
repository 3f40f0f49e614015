"""Mixtral: the Llama layer with a sparse mixture of experts in place of the MLP (``layers/moe.py``).

Each token goes to its top ``num_experts_per_tok`` experts of ``num_local_experts`` (router softmax, the top k
rescaled to sum to 1). Checkpoints name the experts ``block_sparse_moe.experts.M.w1/w3/w2`` (gate, up, down);
the loader renames them to the names Qwen3-MoE uses, and ``ExpertLoading`` stacks them into the layer's
``w13``/``w2``. Steps run in torch (the native CPU path is the dense Llama layer's); experts on the CPU grouped
GEMM, on CUDA the Triton fused-MoE kernel.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from services.worker.attention.base import AttentionBackend
from services.worker.layers.moe import SparseMoE
from services.worker.models.llama import DecoderLayer, LlamaArgs, LlamaForCausalLM
from services.worker.quant.formats import PackedWeight

ARCHITECTURES = ("MixtralForCausalLM",)
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_STACKED = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")  # transformers 5's own layout


@dataclass(slots=True)
class MoeArgs(LlamaArgs):
    num_experts: int = 0
    top_k: int = 1
    moe_intermediate_size: int = 0
    renormalize: bool = True
    moe_layers: tuple[bool, ...] = ()  # per layer: experts (True) or the dense MLP

    @classmethod
    def from_moe_config(cls, cfg, num_experts: int, inter: int, renormalize: bool, moe_layers) -> MoeArgs:
        base = LlamaArgs.from_hf_config(cfg)
        fields = {f: getattr(base, f) for f in LlamaArgs.__dataclass_fields__}
        return cls(
            **fields,
            num_experts=num_experts,
            top_k=cfg.num_experts_per_tok,
            moe_intermediate_size=inter,
            renormalize=renormalize,
            moe_layers=tuple(moe_layers),
        )


def mixtral_args(cfg) -> MoeArgs:
    n = cfg.num_hidden_layers
    return MoeArgs.from_moe_config(cfg, cfg.num_local_experts, cfg.intermediate_size, True, [True] * n)


def rename_mixtral(weights: Iterable[tuple[str, torch.Tensor]], args: LlamaArgs) -> Iterator[tuple[str, torch.Tensor]]:
    parts = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
    for name, tensor in weights:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = re.search(r"\.experts\.\d+\.(w[123])\.", name)
        if m:
            name = name[: m.start(1)] + parts[m.group(1)] + name[m.end(1) :]
        yield name, tensor


class MoeDecoderLayer(DecoderLayer):
    def __init__(self, args: MoeArgs, backend: AttentionBackend, layer: int = 0):
        super().__init__(args, backend, layer)
        if args.moe_layers[layer]:
            self.mlp = SparseMoE(
                args.hidden_size, args.moe_intermediate_size, args.num_experts, args.top_k, args.renormalize
            )


class ExpertLoading:
    """Checkpoint experts (one tensor per expert and projection, or transformers 5's stacked ones) into SparseMoE."""

    layers: torch.nn.ModuleList
    args: MoeArgs

    def load_extra(self, name: str, tensor: torch.Tensor | PackedWeight) -> set[str]:
        one, stacked = _EXPERT.fullmatch(name), _STACKED.fullmatch(name)
        if not (one or stacked):
            return set()
        if isinstance(tensor, PackedWeight):
            raise ValueError(f"{name!r}: experts load dequantized (--quantization none)")
        layer = int((one or stacked).group(1))
        moe = self.layers[layer].mlp
        if not isinstance(moe, SparseMoE):
            raise ValueError(f"unexpected weight {name!r}: layer {layer} has a dense MLP")
        inter = moe.intermediate_size
        if stacked:
            part = stacked.group(2)
            target = moe.w13 if part == "gate_up_proj" else moe.w2
            _copy(target.data, tensor, name)
            parts = ("gate_proj", "up_proj") if part == "gate_up_proj" else ("down_proj",)
            return {f"layers.{layer}.mlp.{p}@{e}" for p in parts for e in range(target.shape[0])}
        expert, part = int(one.group(2)), one.group(3)
        if expert >= moe.w13.shape[0]:
            raise ValueError(f"unexpected weight {name!r}: the model has {moe.w13.shape[0]} experts")
        rows = {"gate_proj": moe.w13.data[expert, :inter], "up_proj": moe.w13.data[expert, inter:]}
        _copy(rows.get(part, moe.w2.data[expert]), tensor, name)
        return {f"layers.{layer}.mlp.{part}@{expert}"}

    def extra_expected(self) -> dict[str, set[str]]:
        out = {}
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoE):
                experts = range(layer.mlp.w13.shape[0])
                out[f"layers.{i}.mlp.w13"] = {
                    f"layers.{i}.mlp.{p}@{e}" for p in ("gate_proj", "up_proj") for e in experts
                }
                out[f"layers.{i}.mlp.w2"] = {f"layers.{i}.mlp.down_proj@{e}" for e in experts}
        return out


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.copy_(tensor)


class MixtralForCausalLM(ExpertLoading, LlamaForCausalLM):
    decoder_layer = MoeDecoderLayer
    native_cpu = False
