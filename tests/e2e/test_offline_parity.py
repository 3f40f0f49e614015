"""Offline ``LLM`` on the default model in float32: equal to transformers' greedy generate, and equal to the
served stack (same requests through gRPC) token for token, including seeded sampling and stop strings.

It lives beside the end-to-end suite to share its session stack and transformers reference rather than start
a second stack (tests/offline holds the tiny-model tests). The offline engine runs in a process of its own
(``offline_run.py``), as a user's program would.
"""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvgrid import SamplingParams
from kvgrid.v1 import generate_pb2
from tests.e2e.conftest import FP32_ARGS
from tests.e2e.hf_reference import strip_eos
from tests.e2e.stack import child_env
from tests.e2e.test_equivalence import CONVERSATIONS, MAX_TOKENS, PROMPTS, run_all

# Standalone it also pays for the transformers reference runs that test_equivalence caches in the full suite.
pytestmark = pytest.mark.timeout(1200)

GREEDY = dict(max_tokens=MAX_TOKENS)
# Per prompt: greedy, seeded sampling with each filter and penalty, a stop string with logprobs.
CASES = [
    GREEDY,
    dict(max_tokens=32, temperature=0.8, top_p=0.95, seed=7),
    dict(max_tokens=32, temperature=1.1, top_k=40, seed=11, presence_penalty=0.5),
    dict(max_tokens=32, temperature=0.7, min_p=0.05, seed=13, repetition_penalty=1.2),
    dict(max_tokens=32, stop=[" the", "\n"], logprobs=2),
]
SAMPLED_CHAT = CASES[1]


def llm_options(args: list[str]) -> dict[str, str]:
    """The stack's flags as LLM keyword options (--kv-cache-memory 512MiB -> kv_cache_memory="512MiB")."""
    return {flag.removeprefix("--").replace("-", "_"): value for flag, value in zip(args[::2], args[1::2], strict=True)}


@pytest.fixture(scope="module")
def offline() -> SimpleNamespace:
    """Every request of this module through one offline LLM, in a separate process."""
    spec = {
        "options": llm_options(FP32_ARGS),
        "generate": [[p, GREEDY] for p in PROMPTS] + [[p, c] for p in PROMPTS for c in CASES],
        "chat": [[c, GREEDY] for c in CONVERSATIONS] + [[c, SAMPLED_CHAT] for c in CONVERSATIONS],
    }
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.offline_run"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=900,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    n, k = len(PROMPTS), len(CONVERSATIONS)
    as_ns = [SimpleNamespace(**r) for r in out["generate"]]
    chats = [SimpleNamespace(**r) for r in out["chat"]]
    return SimpleNamespace(
        eos_ids=out["eos_token_ids"], greedy=as_ns[:n], cases=as_ns[n:], greedy_chats=chats[:k], sampled_chats=chats[k:]
    )


def assert_equal_to_transformers(hf, outputs, prompts_ids: list[list[int]], eos_ids: list[int]) -> None:
    for prompt_ids, out in zip(prompts_ids, outputs, strict=True):
        expected = strip_eos(hf.greedy(prompt_ids, MAX_TOKENS, eos_ids), eos_ids)
        assert out.prompt_token_ids == prompt_ids
        assert strip_eos(out.token_ids, eos_ids) == expected, out.prompt
        assert out.text == hf.decode(expected), out.prompt
        assert out.finish_reason == ("length" if len(out.token_ids) == MAX_TOKENS else "stop")


def test_greedy_equals_transformers(hf, offline):
    assert_equal_to_transformers(hf, offline.greedy, [hf.encode(p) for p in PROMPTS], offline.eos_ids)
    assert_equal_to_transformers(hf, offline.greedy_chats, [hf.chat_ids(c) for c in CONVERSATIONS], offline.eos_ids)
    assert "Paris" in offline.greedy_chats[0].text


def test_equals_the_served_stack(offline, channel):
    requests = [
        generate_pb2.GenerateRequest(prompt=p, sampling=SamplingParams(**c).to_proto()) for p in PROMPTS for c in CASES
    ]
    served = run_all(channel, requests)
    for request, out, (text, ids, last) in zip(requests, offline.cases, served, strict=True):
        where = (request.prompt, request.sampling)
        assert out.token_ids == ids, where
        assert out.text == text, where
        assert out.finish_reason == last.finish_reason, where
        assert (out.num_prompt_tokens, out.num_completion_tokens) == (
            last.usage.prompt_tokens,
            last.usage.completion_tokens,
        ), where
        if request.sampling.logprobs:
            assert [lp["token_id"] for lp in out.logprobs] == ids
    stopped = offline.cases[len(CASES) - 1 :: len(CASES)]
    assert any(out.finish_reason == "stop" and out.num_completion_tokens < 32 for out in stopped)
    chat_requests = [
        generate_pb2.ChatRequest(
            messages=[generate_pb2.ChatMessage(**m) for m in c], sampling=SamplingParams(**SAMPLED_CHAT).to_proto()
        )
        for c in CONVERSATIONS
    ]
    served_chats = run_all(channel, chat_requests)
    assert [(c.text, c.token_ids) for c in offline.sampled_chats] == [(text, ids) for text, ids, _ in served_chats]
