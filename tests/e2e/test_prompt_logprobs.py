"""Prompt logprobs on a real `kvgrid serve` (a tiny float32 Llama, a prefill chunk of 32 tokens, a KV cache small
enough to preempt) equal transformers' log-softmax of the same prompt to 1e-4: over gRPC, over HTTP (completions
echo with logprobs, vLLM's prompt_logprobs on completions and chat), for a prompt longer than the chunk, a prompt
whose prefix is cached, and requests preempted while they run."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import Stack, get_stats, running_stack, wait_idle
from tests.e2e.tiny_bytelevel import PromptReference, save_bytelevel_model

pytestmark = pytest.mark.timeout(600)

CHUNK = 32
# 8 KiB per block of 16 tokens (2 layers, 2 KV heads of 16, float32): 24 blocks, 384 tokens.
ARGS = [
    "--dtype", "float32", "--kv-cache-memory", "192KiB", "--max-model-len", "384",
    "--max-num-batched-tokens", str(CHUNK), "--block-size", "16",
]  # fmt: skip
TEXT = "the truth is that no one knows true words: true, no? " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_bytelevel_model(tmp_path_factory.mktemp("bytelevel-llama"))


@pytest.fixture(scope="module")
def reference(model_dir) -> PromptReference:
    return PromptReference(model_dir)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_dir) -> Stack:
    with running_stack(tmp_path_factory.mktemp("prompt-logprobs") / "serve.log", ["--model", model_dir, *ARGS]) as s:
        yield s


@pytest.fixture(scope="module")
def stub(stack) -> generate_pb2_grpc.TextGenerationStub:
    with grpc.insecure_channel(stack.addr) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


@pytest.fixture(scope="module")
def scheduler(stack) -> grpc.Channel:
    with grpc.insecure_channel(stack.scheduler_addr) as channel:
        yield channel


def ids_of(stub, text: str) -> list[int]:
    return list(stub.Tokenize(generate_pb2.TokenizeRequest(text=text), timeout=30).token_ids)


def generate(stub, prompt_ids: list[int], **sampling) -> tuple[list, list[int], generate_pb2.GenerateResponse]:
    """(prompt logprobs, output ids, last message) of a greedy Generate over ``prompt_ids``."""
    request = generate_pb2.GenerateRequest(prompt_token_ids=prompt_ids, sampling=common_pb2.SamplingParams(**sampling))
    prompt_logprobs, output, last = [], [], None
    for response in stub.Generate(request, timeout=300):
        prompt_logprobs += response.prompt_logprobs
        output += response.token_ids
        last = response
    return prompt_logprobs, output, last


def post(stack: Stack, path: str, body: dict) -> tuple[int, dict]:
    url = f"http://127.0.0.1:{stack.ports['--http-port']}/v1/{path}"
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_grpc_prompt_longer_than_the_prefill_chunk(stub, reference):
    prompt = ids_of(stub, TEXT)
    assert len(prompt) > 2 * CHUNK
    entries, output, last = generate(stub, prompt, max_tokens=3, prompt_logprobs=4)
    assert len(entries) == len(prompt) - 1  # each position once, across the chunks
    reference.check(prompt, entries, num_top=4)
    assert all(e.token for e in entries)  # named by the frontend
    assert last.usage.prompt_tokens == len(prompt) and len(output) == 3


def test_zero_top_gives_the_token_alone_and_a_one_token_prompt_none(stub, reference):
    prompt = ids_of(stub, "no true words")
    entries, _, _ = generate(stub, prompt, max_tokens=1, prompt_logprobs=0)
    reference.check(prompt, entries, num_top=0)
    entries, output, _ = generate(stub, prompt[:1], max_tokens=2, prompt_logprobs=5)
    assert entries == [] and len(output) == 2


def test_a_cached_prefix_is_computed_again_for_a_request_that_scores_it(stub, scheduler, reference):
    prefix = ids_of(stub, "true words, cached: " * 6)
    assert len(prefix) >= 32
    generate(stub, prefix, max_tokens=1)  # its full blocks are cached now
    prompt = prefix + ids_of(stub, " and then no one knows")
    entries, _, last = generate(stub, prompt, max_tokens=1, prompt_logprobs=2)
    assert last.usage.cached_prompt_tokens == 0
    reference.check(prompt, entries, num_top=2)
    # The prefix was there to be hit: a request that does not score its prompt reads it.
    _, _, plain = generate(stub, prompt + ids_of(stub, " ok"), max_tokens=1)
    assert plain.usage.cached_prompt_tokens >= 32


def test_preempted_requests_keep_exact_prompt_logprobs(stub, scheduler, reference):
    prompts = [ids_of(stub, f"{i} " + TEXT[: 90 + 17 * i]) for i in range(5)]
    before = wait_idle(scheduler).num_preemptions

    def run(prompt):
        return generate(stub, prompt, max_tokens=150, ignore_eos=True, prompt_logprobs=3)

    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(run, prompts))
    assert get_stats(scheduler).num_preemptions > before  # the pool holds about two of these at a time
    for prompt, (entries, output, _) in zip(prompts, results, strict=True):
        assert len(output) == 150
        assert len(entries) == len(prompt) - 1  # none twice, none missing
        reference.check(prompt, entries, num_top=3)


def test_completions_echo_with_logprobs_leads_with_the_prompt(stack, stub, reference):
    prompt = ids_of(stub, TEXT)
    status, body = post(
        stack,
        "completions",
        {"prompt": TEXT, "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0},
    )
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["text"].startswith(TEXT)
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 1  # the prompt's tokens, then the generated one
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference.logprobs(prompt)
    for p in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, prompt[p]].item()) < 1e-4
        # Keyed by text: ids that decode alike (ids past the tokenizer's, stray bytes) share one entry.
        best = ref[p - 1].topk(2).values.tolist()
        assert 1 <= len(lp["top_logprobs"][p]) <= 2
        assert all(min(abs(v - b) for b in best) < 1e-4 for v in lp["top_logprobs"][p].values())
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert "prompt_logprobs" not in choice  # vLLM's field, only when asked for


def test_vllm_prompt_logprobs_on_completions_and_chat(stack, stub, reference):
    prompt = ids_of(stub, "true words")
    status, body = post(stack, "completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 1})
    assert status == 200, body
    got = body["choices"][0]["prompt_logprobs"]
    ref = reference.logprobs(prompt)
    assert got[0] is None and len(got) == len(prompt)
    for p in range(1, len(prompt)):
        entry = got[p][str(prompt[p])]
        assert abs(entry["logprob"] - ref[p - 1, prompt[p]].item()) < 1e-4
        assert entry["rank"] == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
        assert str(ref[p - 1].argmax().item()) in got[p]

    messages = [{"role": "user", "content": "no one knows true words"}]
    status, body = post(stack, "chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert status == 200, body
    chat_ids = list(stub.Tokenize(generate_pb2.TokenizeRequest(messages=messages), timeout=30).token_ids)
    got, ref = body["prompt_logprobs"], reference.logprobs(chat_ids)
    assert got[0] is None and len(got) == len(chat_ids)
    for p in range(1, len(chat_ids)):
        assert list(got[p]) == [str(chat_ids[p])]  # 0 alternatives: the token alone
        assert abs(got[p][str(chat_ids[p])]["logprob"] - ref[p - 1, chat_ids[p]].item()) < 1e-4


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("completions", {"prompt": "no", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt": "no", "echo": True, "logprobs": 21}, "logprobs"),
        ("completions", {"prompt": "no", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"prompt": "no", "prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_prompt_logprobs_are_400_naming_the_field(stack, path, body, field):
    status, answer = post(stack, path, body)
    assert status == 400, answer
    assert answer["error"]["param"] == field or field in answer["error"]["message"]


def test_grpc_refuses_more_than_20(stub):
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, [5, 6, 7], prompt_logprobs=21)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs" in info.value.details()


def test_a_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(stack):
    body = {"prompt": "no one knows", "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    _, whole = post(stack, "completions", body)
    url = f"http://127.0.0.1:{stack.ports['--http-port']}/v1/completions"
    request = urllib.request.Request(
        url, json.dumps({**body, "stream": True}).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [line[6:] for line in response.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    expected = whole["choices"][0]["logprobs"]
    assert chunks[0]["text"].startswith("no one knows")
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    streamed = {key: [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] for key in expected}
    assert streamed == expected
    assert "".join(c["text"] for c in chunks) == whole["choices"][0]["text"]


def test_the_default_model_scores_like_transformers(channel, hf):
    """SmolLM2 from its GGUF file, through the native CPU path, against transformers on the same file."""
    text = "The capital of France is Paris. It is known for the Eiffel Tower, its museums and its food. " * 3
    prompt = hf.encode(text)
    entries, _, _ = generate(generate_pb2_grpc.TextGenerationStub(channel), prompt, max_tokens=1, prompt_logprobs=1)
    with torch.inference_mode():
        logits = hf.ready().model(torch.tensor([prompt])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    assert [e.token_id for e in entries] == prompt[1:]
    for p, entry in enumerate(entries):
        assert abs(entry.logprob - ref[p, prompt[p + 1]].item()) < 1e-4, p
        assert entry.top[0].token_id == ref[p].argmax().item()
