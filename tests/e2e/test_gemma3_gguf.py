"""`kvgrid serve --quantization gguf` on Gemma 3 270M Q4_K_M (its PyPI package): the worker keeps the file's
Q4_K / Q6_K blocks (and Q5_0 as Q8_0) packed and the stack answers; its greedy first token for each prompt is
transformers' float32 one on the same file (``tests/worker/test_kquant_model.py`` checks every step under
teacher forcing)."""

from __future__ import annotations

import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import Stack, collect
from tests.e2e.test_gemma3 import PROMPTS, gguf_path, hf  # noqa: F401 (fixtures)
from tests.e2e.test_serve_default import kvgrid

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, gguf_path):  # noqa: F811
    args = ["--model", gguf_path, "--quantization", "gguf", "--kv-cache-memory", "256MiB", "--max-model-len", "2048"]
    stack = Stack(tmp_path_factory.mktemp("gemma3-gguf") / "serve.log", args).start()
    try:
        yield stack.wait_ready(timeout=900)
    finally:
        stack.stop()


def test_greedy_first_token_equals_transformers(stack, hf):  # noqa: F811
    import grpc

    with grpc.insecure_channel(stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        eos_ids = list(stub.GetModelInfo(generate_pb2.GetModelInfoRequest()).eos_token_ids)
        for prompt in PROMPTS[:3]:
            sampling = common_pb2.SamplingParams(max_tokens=8, temperature=0.0)
            _, ids, last = collect(stub.Generate(generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling)))
            prompt_ids = hf.encode(prompt)
            assert last.usage.prompt_tokens == len(prompt_ids), prompt
            assert ids[0] == hf.greedy(prompt_ids, 1, eos_ids)[0], prompt


def test_kvgrid_generate_answers(stack):
    proc = kvgrid("generate", "The capital of France is", "--addr", stack.addr, "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
