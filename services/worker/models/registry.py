"""The model families kvgrid computes, by Hugging Face ``model_type``: which class, which config reader, and how a
family's checkpoint names map onto the class's parameters where they differ from the Llama ones."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from services.worker.models import gemma3, idefics3, llava, mixtral, phi3, qwen3, qwen3_moe
from services.worker.models.llama import LlamaArgs, LlamaForCausalLM

Weights = Iterable[tuple[str, torch.Tensor]]


def _same(weights: Weights, args: LlamaArgs) -> Iterator[tuple[str, torch.Tensor]]:
    yield from weights


def _no_check(cfg: Any) -> None:
    return None


@dataclass(frozen=True, slots=True)
class Family:
    model: type[LlamaForCausalLM]
    architectures: tuple[str, ...]
    read_args: Callable[[Any], LlamaArgs] = LlamaArgs.from_hf_config
    check: Callable[[Any], None] = _no_check  # raises ValueError for a variant the class does not compute
    rename: Callable[[Weights, LlamaArgs], Weights] = _same  # checkpoint tensors -> the names the class loads


FAMILIES: dict[str, Family] = {
    "llama": Family(LlamaForCausalLM, ("LlamaForCausalLM",)),
    "mistral": Family(LlamaForCausalLM, ("MistralForCausalLM",)),
    "qwen2": Family(LlamaForCausalLM, ("Qwen2ForCausalLM",)),
    "qwen3": Family(qwen3.Qwen3ForCausalLM, qwen3.ARCHITECTURES),
    "phi3": Family(LlamaForCausalLM, phi3.ARCHITECTURES, check=phi3.check_phi3, rename=phi3.split_fused),
    "gemma3_text": Family(gemma3.Gemma3ForCausalLM, gemma3.ARCHITECTURES, read_args=gemma3.Gemma3Args.from_hf_config),
    "mixtral": Family(
        mixtral.MixtralForCausalLM, mixtral.ARCHITECTURES, read_args=mixtral.mixtral_args, rename=mixtral.rename_mixtral
    ),
    "qwen3_moe": Family(qwen3_moe.Qwen3MoeForCausalLM, qwen3_moe.ARCHITECTURES, read_args=qwen3_moe.qwen3_moe_args),
    "llava": Family(
        llava.LlavaForCausalLM,
        llava.ARCHITECTURES,
        read_args=llava.LlavaArgs.from_hf_config,
        check=llava.check_llava,
        rename=llava.rename_llava,
    ),
    "idefics3": Family(
        idefics3.Idefics3ForCausalLM,
        idefics3.ARCHITECTURES,
        read_args=idefics3.Idefics3Args.from_hf_config,
        check=idefics3.check_idefics3,
        rename=idefics3.rename_idefics3,
    ),
}
ARCHITECTURES = tuple(a for family in FAMILIES.values() for a in family.architectures)


def family_of(model_type: str, architecture: str | None) -> Family | None:
    family = FAMILIES.get(model_type)
    if family is None or (architecture and architecture not in family.architectures):
        return None
    return family
