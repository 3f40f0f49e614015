"""LoRA on the default model (the embedded SmolLM2-135M GGUF) through `kvgrid serve`, float32 greedy: three adapters
and the base, alone and mixed in 16 concurrent requests, equal to peft's PeftModel on transformers."""

from __future__ import annotations

import concurrent.futures
import os

import grpc
import pytest
import torch

from kvgrid.v1 import generate_pb2_grpc
from services.common.default_model import default_model_path
from tests.e2e.stack import running_stack
from tests.lora.adapters import save_adapter
from tests.lora.test_serve_lora import generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

NAMES = ("sql", "chat", "math")
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = default_model_path()
    directory, name = os.path.dirname(path), os.path.basename(path)

    def load():
        return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()

    base = load()
    adapters = {
        n: save_adapter("", str(tmp_path_factory.mktemp(f"smol-{n}")), seed=i, rank=8, std=0.15, base=base)
        for i, n in enumerate(NAMES)
    }
    models = {None: base} | {n: PeftModel.from_pretrained(load(), p).eval() for n, p in adapters.items()}
    return adapters, models


def greedy(model, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_default_model_adapters_equal_peft(tmp_path, reference):
    adapters, models = reference
    modules = [f"{n}={p}" for n, p in adapters.items()]
    args = ["--dtype", "float32", "--kv-cache-memory", "512MiB", "--max-model-len", "512"]
    args += ["--enable-lora", "--lora-modules", *modules, "--max-loras", "3", "--max-lora-rank", "8"]
    # Four prompts, each under the base and every adapter.
    cases = [((None, *NAMES)[i % 4], [1, 504 + 37 * (i // 4), 1116, 314 + i // 4, 28, 5]) for i in range(16)]
    expected = [greedy(models[name], prompt) for name, prompt in cases]
    assert len({tuple(e) for e in expected[:4]}) == 4  # one prompt: each adapter answers its own way
    with running_stack(tmp_path / "serve.log", args) as stack, grpc.insecure_channel(stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        alone = [generate(stub, prompt, name or "", MAX_TOKENS) for name, prompt in cases[:4]]
        assert alone == expected[:4]
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(generate, stub, prompt, name or "", MAX_TOKENS) for name, prompt in cases]
            assert [f.result() for f in futures] == expected
