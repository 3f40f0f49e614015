"""PEFT LoRA adapters made in the test on a tiny random model, with random non-zero A and B."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_adapter(
    base_path: str,
    path: str,
    seed: int,
    rank: int = 8,
    alpha: int = 16,
    targets: tuple[str, ...] = ALL_TARGETS,
    rslora: bool = False,
    std: float = 0.3,
    base=None,
) -> str:
    """A LoRA adapter over the model at ``base_path`` (or ``base``, that model already loaded); A and B random and
    non-zero (init_lora_weights=False), of standard deviation ``std``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    if base is None:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        init_lora_weights=False,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    torch.manual_seed(seed)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * std)
    model.save_pretrained(path)
    model.unload()  # ``base`` back as it was (a caller may make another adapter over it)
    return path


def peft_model(base_path: str, adapter_path: str):
    """transformers + peft's PeftModel: the reference an adapter's output must equal."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_path).eval()


def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt_ids) :].tolist()
