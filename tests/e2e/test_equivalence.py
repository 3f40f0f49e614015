"""Greedy float32 output equals `transformers` greedy generation, token for token (DESIGN §2)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.hf_reference import strip_eos
from tests.e2e.stack import collect

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 48
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Les trois plus grandes villes de France sont",
    "東京は日本の首都で、",
    "Привет! Меня зовут Анна, и я",
    "1, 1, 2, 3, 5, 8, 13,",
    "Emojis like 🙂 and 🚀 are used to",
    "Q: Why is the sky blue?\nA:",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a primary color."},
    ],
    [
        {"role": "user", "content": "Give me a number between 1 and 10."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Now double it and explain ¿por qué?"},
    ],
]


def greedy(max_tokens: int = MAX_TOKENS) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)


@pytest.fixture(scope="module")
def eos_ids(channel) -> list[int]:
    info = generate_pb2_grpc.TextGenerationStub(channel).GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
    assert info.dtype == "float32"
    return list(info.eos_token_ids)


def run_all(channel, requests: list) -> list[tuple[str, list[int], generate_pb2.GenerateResponse]]:
    """All requests at once (continuous batching must not change greedy output)."""
    stub = generate_pb2_grpc.TextGenerationStub(channel)

    def one(request):
        call = stub.Chat if isinstance(request, generate_pb2.ChatRequest) else stub.Generate
        return collect(call(request, timeout=300))

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(one, requests))


def test_generate_equals_transformers_greedy(hf, channel, eos_ids):
    results = run_all(channel, [generate_pb2.GenerateRequest(prompt=p, sampling=greedy()) for p in PROMPTS])
    for prompt, (text, ids, last) in zip(PROMPTS, results, strict=True):
        prompt_ids = hf.encode(prompt)
        expected = hf.greedy(prompt_ids, MAX_TOKENS, eos_ids)
        assert strip_eos(ids, eos_ids) == strip_eos(expected, eos_ids), prompt
        assert text == hf.decode(strip_eos(expected, eos_ids)), prompt
        assert last.usage.prompt_tokens == len(prompt_ids)
        assert last.usage.completion_tokens == len(ids)
        assert last.finish_reason == ("length" if len(ids) == MAX_TOKENS else "stop")


def test_prompt_token_ids_give_the_same_tokens_as_text(hf, channel):
    prompt = PROMPTS[0]
    by_text, by_ids = run_all(
        channel,
        [
            generate_pb2.GenerateRequest(prompt=prompt, sampling=greedy(12)),
            generate_pb2.GenerateRequest(prompt_token_ids=hf.encode(prompt), sampling=greedy(12)),
        ],
    )
    assert by_text[1] == by_ids[1] and by_text[0] == by_ids[0]


def test_chat_equals_transformers_with_the_chat_template(hf, channel, eos_ids):
    requests = [
        generate_pb2.ChatRequest(messages=[generate_pb2.ChatMessage(**m) for m in conv], sampling=greedy())
        for conv in CONVERSATIONS
    ]
    results = run_all(channel, requests)
    for conv, (text, ids, last) in zip(CONVERSATIONS, results, strict=True):
        prompt_ids = hf.chat_ids(conv)
        expected = hf.greedy(prompt_ids, MAX_TOKENS, eos_ids)
        assert strip_eos(ids, eos_ids) == strip_eos(expected, eos_ids), conv
        assert text == hf.decode(strip_eos(expected, eos_ids)), conv
        assert last.usage.prompt_tokens == len(prompt_ids)
    assert "Paris" in results[0][0]
