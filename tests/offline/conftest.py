"""A tiny random Llama with a word-level tokenizer ("t0 t1 ..." -> ids) and a chat template, and an LLM on it."""

from __future__ import annotations

import pytest

from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

# Turns are "t2 <content> t3"; the generation prompt is t4. Words outside t0..t149 are <unk>.
CHAT_TEMPLATE = (
    "{% for m in messages %}t2 {{ m['content'] }} t3 {% endfor %}{% if add_generation_prompt %}t4{% endif %}"
)
TINY_OPTIONS = dict(dtype="float32", max_model_len=128, num_threads=1)


def word_prompt(i: int, length: int) -> str:
    return " ".join(f"t{(i * 7 + j * 3) % 150 + 5}" for j in range(length))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    from transformers import AutoTokenizer

    path = str(tmp_path_factory.mktemp("tiny-llama"))
    save_tiny_model(path, max_position_embeddings=128)
    save_tiny_tokenizer(path, vocab_size=158)  # every id of the model (160) decodes
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    import torch

    from kvgrid import LLM

    threads = torch.get_num_threads()
    yield LLM(model=tiny_model, kv_cache_memory="8MiB", **TINY_OPTIONS)
    torch.set_num_threads(threads)
