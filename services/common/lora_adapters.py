"""A PEFT LoRA adapter directory checked without reading its tensors (no torch): what the frontend verifies when an
adapter is named (--lora-modules, /v1/load_lora_adapter) and the worker again when it reads the factors."""

from __future__ import annotations

import json
import os

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The checkpoint modules an adapter may target: the attention and MLP projections of the Llama family.
SUPPORTED_TARGETS = frozenset(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


class LoraError(ValueError):
    """An adapter this worker cannot serve: the message says why."""


def read_config(path: str) -> dict:
    """The adapter's config, checked for what this worker supports; raises LoraError. Needs no torch."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise LoraError(f"no {CONFIG_FILE} in {path!r}")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise LoraError(f"no {WEIGHTS_FILE} in {path!r}")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoraError(f"{path!r} is a {config.get('peft_type')} adapter, not LoRA")
    if config.get("use_dora"):
        raise LoraError(f"{path!r} is a DoRA adapter; only plain LoRA is served")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise LoraError(f"{path!r} trains biases or whole modules; only the LoRA factors are served")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    unsupported = sorted(set(targets) - SUPPORTED_TARGETS)
    if unsupported:
        raise LoraError(f"{path!r} targets {', '.join(unsupported)}; served: {', '.join(sorted(SUPPORTED_TARGETS))}")
    return config


def check_rank(config: dict, max_rank: int, path: str) -> None:
    ranks = [int(config.get("r", 8)), *(int(r) for r in (config.get("rank_pattern") or {}).values())]
    if max(ranks) > max_rank:
        raise LoraError(f"{path!r} has rank {max(ranks)}, over --max-lora-rank {max_rank}")
