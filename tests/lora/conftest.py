"""A tiny random Llama with its tokenizer, four PEFT adapters over it, and their greedy reference (PeftModel)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tests.lora.adapters import peft_model, save_adapter
from tests.worker.tiny import hf_model, save_tiny_model, save_tiny_tokenizer

ADAPTERS = {  # name -> (seed, rank, alpha, targets, rslora)
    "sql": (1, 8, 16, None, False),
    "chat": (2, 4, 8, ("q_proj", "v_proj", "down_proj"), False),
    "math": (3, 16, 16, None, True),
    "code": (4, 8, 32, ("o_proj", "gate_proj", "up_proj"), False),
}
MAX_TOKENS = 8


@dataclass
class TinyLora:
    base: str
    adapters: dict[str, str]  # name -> directory
    _models: dict = field(default_factory=dict)
    _greedy: dict = field(default_factory=dict)

    def model(self, name: str | None):
        if name not in self._models:
            self._models[name] = hf_model(self.base) if name is None else peft_model(self.base, self.adapters[name])
        return self._models[name]

    def greedy(self, name: str | None, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        """transformers (+ peft) greedy, EOS not special (the requests set ignore_eos)."""
        key = (name, tuple(prompt), max_tokens)
        if key not in self._greedy:
            ids = list(prompt)
            model = self.model(name)
            with torch.inference_mode():
                for _ in range(max_tokens):
                    ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            self._greedy[key] = ids[len(prompt) :]
        return self._greedy[key]


def prompt_ids(i: int, length: int = 12) -> list[int]:
    return [(i * 37 + j * 11) % 150 + 3 for j in range(length)]


@pytest.fixture(scope="session")
def tiny_lora(tmp_path_factory) -> TinyLora:
    base = str(tmp_path_factory.mktemp("lora-base"))
    save_tiny_model(base, max_position_embeddings=256)
    save_tiny_tokenizer(base, vocab_size=158)
    adapters = {}
    for name, (seed, rank, alpha, targets, rslora) in ADAPTERS.items():
        kw = {"targets": targets} if targets else {}
        adapters[name] = save_adapter(
            base, str(tmp_path_factory.mktemp(f"lora-{name}")), seed, rank, alpha, rslora=rslora, **kw
        )
    return TinyLora(base, adapters)
