"""Offline ``LLM`` on the default model in float32: equal to transformers' greedy generate, and equal to the
served stack (same requests through gRPC) token for token, including seeded sampling and stop strings.

It lives beside the end-to-end suite to share its session stack and transformers reference rather than start
a second stack (tests/offline holds the tiny-model tests).
"""

from __future__ import annotations

import pytest

from kvgrid import LLM, SamplingParams
from kvgrid.v1 import generate_pb2
from tests.e2e.conftest import FP32_ARGS
from tests.e2e.hf_reference import strip_eos
from tests.e2e.test_equivalence import CONVERSATIONS, MAX_TOKENS, PROMPTS, run_all

# Standalone it also pays for the transformers reference runs that test_equivalence caches in the full suite.
pytestmark = pytest.mark.timeout(1200)


def llm_options(args: list[str]) -> dict[str, str]:
    """The stack's flags as LLM keyword options (--kv-cache-memory 512MiB -> kv_cache_memory="512MiB")."""
    return {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(args[::2], args[1::2], strict=True)}


@pytest.fixture(scope="module")
def llm(hf) -> LLM:
    hf.ready()  # transformers is imported lazily: a second thread importing it meanwhile may see it half-built
    return LLM(**llm_options(FP32_ARGS))


def sampling_cases() -> list[SamplingParams]:
    """Per prompt: greedy, seeded sampling with each filter, a stop string, logprobs."""
    return [
        SamplingParams(max_tokens=MAX_TOKENS),
        SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, seed=7),
        SamplingParams(max_tokens=32, temperature=1.1, top_k=40, seed=11, presence_penalty=0.5),
        SamplingParams(max_tokens=32, temperature=0.7, min_p=0.05, seed=13, repetition_penalty=1.2),
        SamplingParams(max_tokens=32, stop=[" the", "\n"], logprobs=2),
    ]


def assert_equal_to_transformers(hf, outputs, prompts_ids: list[list[int]], eos_ids: list[int]) -> None:
    for prompt_ids, out in zip(prompts_ids, outputs, strict=True):
        expected = strip_eos(hf.greedy(prompt_ids, MAX_TOKENS, eos_ids), eos_ids)
        assert out.prompt_token_ids == prompt_ids
        assert strip_eos(out.token_ids, eos_ids) == expected, out.prompt
        assert out.text == hf.decode(expected), out.prompt
        assert out.finish_reason == ("length" if len(out.token_ids) == MAX_TOKENS else "stop")


def test_greedy_equals_transformers(hf, llm):
    eos_ids = list(llm.engine.core.handshake.eos_token_ids)
    greedy = SamplingParams(max_tokens=MAX_TOKENS)
    results = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert_equal_to_transformers(hf, results, [hf.encode(p) for p in PROMPTS], eos_ids)
    chats = llm.chat(CONVERSATIONS, greedy, use_tqdm=False)
    assert_equal_to_transformers(hf, chats, [hf.chat_ids(c) for c in CONVERSATIONS], eos_ids)
    assert "Paris" in chats[0].text


def test_equals_the_served_stack(llm, channel):
    cases = sampling_cases()
    prompts = [p for p in PROMPTS for _ in cases]
    params = [c for _ in PROMPTS for c in cases]
    offline = llm.generate(prompts, params, use_tqdm=False)
    served = run_all(
        channel,
        [generate_pb2.GenerateRequest(prompt=p, sampling=s.to_proto()) for p, s in zip(prompts, params, strict=True)],
    )
    for prompt, s, out, (text, ids, last) in zip(prompts, params, offline, served, strict=True):
        where = (prompt, s)
        assert out.token_ids == ids, where
        assert out.text == text, where
        assert out.finish_reason == last.finish_reason, where
        assert (out.num_prompt_tokens, out.num_completion_tokens) == (
            last.usage.prompt_tokens,
            last.usage.completion_tokens,
        ), where
    assert any(out.finish_reason == "stop" and out.num_completion_tokens < 32 for out in offline[4 :: len(cases)])
    chats = llm.chat(CONVERSATIONS, cases[1], use_tqdm=False)
    served_chats = run_all(
        channel,
        [
            generate_pb2.ChatRequest(messages=[generate_pb2.ChatMessage(**m) for m in c], sampling=cases[1].to_proto())
            for c in CONVERSATIONS
        ],
    )
    assert [(c.text, c.token_ids) for c in chats] == [(text, ids) for text, ids, _ in served_chats]
