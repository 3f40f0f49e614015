"""The default model served with n-gram speculation: greedy float32 output still equals `transformers` greedy.

One `kvgrid serve --speculative-config` stack for the module. The prompts are the equivalence suite's, plus
input-grounded ones (repeat or edit a text given in the prompt) where proposals are accepted; the worker's
/metrics must show that they were. Aborted requests in the middle of the batch change nothing for the others.
"""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvgrid.v1 import generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import FP32_ARGS
from tests.e2e.hf_reference import strip_eos
from tests.e2e.stack import collect, running_stack, wait_idle
from tests.e2e.test_equivalence import CONVERSATIONS, MAX_TOKENS, PROMPTS, greedy

# A second stack of the default model: beyond `make test`'s time budget.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
DOCUMENT = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
)
GROUNDED = [
    f"Here is some code:\n{DOCUMENT}\nThe same code again, unchanged:\n",
    f"{DOCUMENT}\n# The same functions, with type hints:\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The",
]


@pytest.fixture(scope="module")
def spec_stack(tmp_path_factory, hf):
    args = [*FP32_ARGS, "--speculative-config", json.dumps(NGRAM)]
    with running_stack(tmp_path_factory.mktemp("spec") / "serve.log", args) as stack:
        yield stack


@pytest.fixture(scope="module")
def spec_channel(spec_stack):
    with grpc.insecure_channel(spec_stack.addr) as ch:
        yield ch


def worker_metric(stack, name: str) -> float:
    port = stack.ports["--worker-metrics-port"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_greedy_with_ngram_speculation_equals_transformers(hf, spec_stack, spec_channel):
    stub = generate_pb2_grpc.TextGenerationStub(spec_channel)
    eos_ids = list(stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30).eos_token_ids)
    requests = [generate_pb2.GenerateRequest(prompt=p, sampling=greedy()) for p in PROMPTS + GROUNDED]
    requests += [
        generate_pb2.ChatRequest(messages=[generate_pb2.ChatMessage(**m) for m in conv], sampling=greedy())
        for conv in CONVERSATIONS
    ]
    # Requests aborted mid-stream run beside the others.
    doomed = [generate_pb2.GenerateRequest(prompt=GROUNDED[0], sampling=greedy(200)) for _ in range(3)]

    def one(request):
        call = stub.Chat if isinstance(request, generate_pb2.ChatRequest) else stub.Generate
        return collect(call(request, timeout=300))

    def aborted(request):
        stream = stub.Generate(request, timeout=300)
        next(stream)
        time.sleep(0.2)
        stream.cancel()

    with ThreadPoolExecutor(len(requests) + len(doomed)) as pool:
        for request in doomed:
            pool.submit(aborted, request)
        results = list(pool.map(one, requests))
    for request, (_, ids, last) in zip(requests, results, strict=True):
        if isinstance(request, generate_pb2.ChatRequest):
            prompt_ids = hf.chat_ids([{"role": m.role, "content": m.content} for m in request.messages])
        else:
            prompt_ids = hf.encode(request.prompt)
        expected = hf.greedy(prompt_ids, MAX_TOKENS, eos_ids)
        assert strip_eos(ids, eos_ids) == strip_eos(expected, eos_ids), request
        assert last.usage.completion_tokens == len(ids)
    with grpc.insecure_channel(spec_stack.scheduler_addr) as scheduler:
        wait_idle(scheduler)
    accepted = worker_metric(spec_stack, "kvgrid_spec_decode_num_accepted_tokens_total")
    proposed = worker_metric(spec_stack, "kvgrid_spec_decode_num_draft_tokens_total")
    assert 0 < accepted <= proposed
    assert worker_metric(spec_stack, "kvgrid_spec_decode_num_drafts_total") > 0
    assert "async scheduling is off: speculative decoding plans one step at a time" in spec_stack.log()
