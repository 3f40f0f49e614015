"""The default SmolLM2 GGUF model: worker configs and the transformers reference loaded from the same file."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from services.common import config as cfg  # noqa: E402
from services.common.default_model import default_model_path  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.\n",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old woodcutter who",
]


def worker_config(
    dtype: str = "float32", kv_cache_memory: int = 64 * 2**20, max_model_len: int = 1024, **overrides
) -> cfg.Config:
    config = cfg.build_config(environ={})
    config.model.dtype = dtype
    config.model.max_model_len = max_model_len
    config.device.device = "cpu"
    config.device.attention_backend = "torch"
    config.cache.kv_cache_memory = kv_cache_memory
    config.network.host = "127.0.0.1"
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(config, section), name, value)
    return config


def hf_reference(dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from the same GGUF file, through transformers' own reader."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()
    return model, tokenizer


def prompt_ids(tokenizer) -> list[list[int]]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    return [tokenizer(p)["input_ids"] for p in [*PROMPTS, chat]]


def hf_greedy(model, token_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (never stopping at EOS) and the logits at each generated position."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([token_ids]),
            attention_mask=torch.ones(1, len(token_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(token_ids) :].tolist(), [s[0] for s in out.logits]
