"""Real `kvgrid serve` stacks on a tiny random Llama: one run as an embedding model (--runner pooling), one as a
generator (to be refused embeddings); and the transformers reference, its last hidden states pooled."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.stack import running_stack
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

# A 40-token step budget: the longer prompts below are prefilled in chunks, the pooled state kept between them.
POOLING_ARGS = [
    "--runner",
    "pooling",
    "--pooling-type",
    "mean",
    "--dtype",
    "float32",
    "--kv-cache-memory",
    "16MiB",
    "--max-model-len",
    "256",
    "--max-num-batched-tokens",
    "40",
    "--num-threads",
    "1",
]
HIDDEN_SIZE = 64  # tests.worker.tiny.BASE


def word_prompt(i: int, length: int) -> str:
    """Words of the tiny tokenizer ("t0 t1 ..."): one token each."""
    return " ".join(f"t{(i * 7 + j * 3) % 150 + 5}" for j in range(length))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-embed"))
    save_tiny_model(path, max_position_embeddings=256)
    save_tiny_tokenizer(path, vocab_size=158)
    return path


@pytest.fixture(scope="session")
def pooling_stack(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("pooling") / "serve.log"
    with running_stack(log, ["--model", tiny_model_dir, *POOLING_ARGS]) as stack:
        yield stack


@pytest.fixture(scope="session")
def generate_stack(tmp_path_factory, tiny_model_dir):
    log = tmp_path_factory.mktemp("generate") / "serve.log"
    args = ["--model", tiny_model_dir, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--num-threads", "1"]
    with running_stack(log, args) as stack:
        yield stack


class PooledReference:
    """transformers' ``last_hidden_state`` (after the final norm) of each prompt alone, pooled in float32."""

    def __init__(self, path: str):
        import transformers

        self.model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(path)

    def ids(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    @torch.no_grad()
    def pool(self, ids: list[int], pooling_type: str, normalize: bool, dimensions: int = 0) -> torch.Tensor:
        hidden = self.model(torch.tensor([ids])).last_hidden_state[0]  # [T, E]
        vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling_type]
        if dimensions:
            vector = vector[:dimensions]
        return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


@pytest.fixture(scope="session")
def reference(tiny_model_dir) -> PooledReference:
    return PooledReference(tiny_model_dir)
