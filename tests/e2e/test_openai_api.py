"""The OpenAI-compatible HTTP API of a real `kvgrid serve`, through the official `openai` client."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request

import openai
import pytest
from openai import AsyncOpenAI

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import collect, get_stats, wait_idle
from tests.e2e.test_bad_inputs import CASES as GRPC_CASES
from tests.e2e.test_bad_inputs import MAX_MODEL_LEN, VOCAB

pytestmark = pytest.mark.timeout(300)

BLOCK_SIZE = 16
PROMPT = "The three primary colors are"
QUESTION = [{"role": "user", "content": "Name two planets of the solar system."}]


def grpc_text(channel, request) -> tuple[str, list[int], generate_pb2.GenerateResponse]:
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    method = stub.Chat if isinstance(request, generate_pb2.ChatRequest) else stub.Generate
    return collect(method(request, timeout=120))


def test_models_lists_the_served_model(client, model):
    assert model == "SmolLM2-135M-Instruct"
    assert [m.id for m in client.models.list().data] == [model]


def test_greedy_completion_and_chat_equal_the_grpc_api(client, model, channel):
    sampling = common_pb2.SamplingParams(max_tokens=16)
    text, ids, last = grpc_text(channel, generate_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling))
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0)
    assert out.choices[0].text == text and out.choices[0].finish_reason == last.finish_reason
    assert out.usage.completion_tokens == len(ids) and out.usage.prompt_tokens == last.usage.prompt_tokens

    messages = [generate_pb2.ChatMessage(**m) for m in QUESTION]
    text, ids, last = grpc_text(channel, generate_pb2.ChatRequest(messages=messages, sampling=sampling))
    chat = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    assert chat.choices[0].message.content == text and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == last.finish_reason and chat.usage.completion_tokens == len(ids)


def test_streams_carry_the_same_text_and_a_usage_chunk(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    whole = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_n_choices_share_the_prompts_blocks(client, model, scheduler_channel):
    prompt = "Here is a long story about a lighthouse keeper, told in many small parts. " * 6
    before = wait_idle(scheduler_channel)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=8, n=3, temperature=1.0, seed=11)
    after = wait_idle(scheduler_channel)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # seed + index per choice: the samples differ
    full_blocks = out.usage.prompt_tokens // BLOCK_SIZE
    assert full_blocks >= 3
    # the two siblings find every full block of the prompt that the first choice computed
    # (the last block may hold the one prompt token that is always computed)
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 2 * (full_blocks - 1) * BLOCK_SIZE
    assert out.usage.prompt_tokens_details.cached_tokens >= (full_blocks - 1) * BLOCK_SIZE


def test_logprobs_on_both_endpoints(client, model):
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and logprob <= 0 and top[token] == pytest.approx(max(top.values()))  # greedy

    chat = client.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert all(bytes(c.bytes) == c.token.encode() for c in content)


def test_stop_strings_end_the_text(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = whole.strip().split()[1]
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and stop not in out.choices[0].text
    assert whole.startswith(out.choices[0].text)


def test_a_seed_reproduces_the_sample(client, model):
    def sample(seed):
        return (
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=1.0, seed=seed)
            .choices[0]
            .message.content
        )

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(s) != first for s in (1, 2, 3))


def test_async_client_streams_concurrently(base_url, model, client):
    prompts = [f"{PROMPT} and the number {i} is" for i in range(4)]
    alone = [
        client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text for p in prompts
    ]

    async def run() -> list[str]:
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as aclient:

            async def one(prompt: str) -> str:
                stream = await aclient.completions.create(
                    model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True
                )
                return "".join([c.choices[0].text async for c in stream if c.choices])

            chat = await aclient.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, temperature=0)
            assert chat.choices[0].message.content
            return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == alone


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and "gpt-4" in err.value.body["message"]


def test_a_disconnect_mid_stream_frees_the_blocks(client, model, scheduler_channel):
    stream = client.completions.create(
        model=model, prompt="Count slowly: one, two,", max_tokens=900, stream=True, extra_body={"ignore_eos": True}
    )
    for received, _ in enumerate(stream, 1):
        if received >= 3:
            break
    running = get_stats(scheduler_channel)
    assert running.num_running == 1 and running.num_blocks_used > 0
    stream.close()
    stats = wait_idle(scheduler_channel, timeout=30)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


# Every case of the gRPC bad-input table (tests/e2e/test_bad_inputs.py), as the HTTP client sends it:
# (endpoint, body fields, the field the 400 names).
COMPLETION, CHAT = "completions", "chat"
HI = [{"role": "user", "content": "hi"}]
HTTP_CASES = {
    "no prompt": (COMPLETION, dict(prompt=""), "prompt"),
    "prompt and ids": (COMPLETION, dict(prompt=["Hello", 1, 2]), "prompt"),
    "id outside vocab": (COMPLETION, dict(prompt=[5, VOCAB]), "prompt[1]"),
    "prompt too long": (COMPLETION, dict(prompt=[300] * MAX_MODEL_LEN), "prompt"),
    "negative temperature": (COMPLETION, dict(temperature=-0.5), "temperature"),
    "nan temperature": (COMPLETION, dict(temperature=math.nan), "temperature"),
    "top_p above 1": (COMPLETION, dict(top_p=1.5), "top_p"),
    "top_k below -1": (COMPLETION, dict(top_k=-2), "top_k"),
    "min_p above 1": (COMPLETION, dict(min_p=1.5), "min_p"),
    "presence penalty": (COMPLETION, dict(presence_penalty=2.5), "presence_penalty"),
    "frequency penalty": (COMPLETION, dict(frequency_penalty=-3.0), "frequency_penalty"),
    "repetition penalty": (COMPLETION, dict(repetition_penalty=-1.0), "repetition_penalty"),
    "too many logprobs": (COMPLETION, dict(logprobs=1000), "logprobs"),
    "max_tokens past the model": (COMPLETION, dict(max_tokens=MAX_MODEL_LEN + 1), "max_tokens"),
    "min_tokens over max_tokens": (COMPLETION, dict(max_tokens=4, min_tokens=9), "min_tokens"),
    "empty stop string": (COMPLETION, dict(stop=["ok", ""]), "stop[1]"),
    "stop token outside vocab": (COMPLETION, dict(stop_token_ids=[VOCAB + 7]), "stop_token_ids[0]"),
    "huge request id": (COMPLETION, dict(request_id="x" * 1000), "request_id"),
    "no messages": (CHAT, dict(messages=[]), "messages"),
    "unknown role": (CHAT, dict(messages=[*HI, {"role": "wizard", "content": "abracadabra"}]), "messages[1].role"),
    "chat bad sampling": (CHAT, dict(top_p=-0.1), "top_p"),
    "schema not JSON": (CHAT, dict(structured_outputs={"json": "{oops"}), "structured_outputs.json"),
    "schema that does not compile": (
        CHAT,
        dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wizard"}}}),
        "response_format.json_schema.schema",
    ),
    "bad regex": (COMPLETION, dict(structured_outputs={"regex": "a["}), "structured_outputs.regex"),
    "empty choice": (COMPLETION, dict(structured_outputs={"choice": ["yes", ""]}), "structured_outputs.choice[1]"),
    "bad grammar": (CHAT, dict(structured_outputs={"grammar": "start: nothing_here"}), "structured_outputs.grammar"),
    "constraint with ignore_eos": (COMPLETION, dict(structured_outputs={"regex": "a+"}, ignore_eos=True), "ignore_eos"),
}


def test_every_grpc_bad_input_case_has_an_http_counterpart():
    assert {name for name, *_ in GRPC_CASES} <= set(HTTP_CASES)


@pytest.mark.parametrize("name", list(HTTP_CASES))
def test_bad_input_is_400_naming_the_field(base_url, model, scheduler_channel, name):
    endpoint, fields, param = HTTP_CASES[name]
    body = {"model": model, "max_tokens": 4, **fields}
    if endpoint == COMPLETION:
        body.setdefault("prompt", "Hello")
    else:
        body.setdefault("messages", HI)
    path = "chat/completions" if endpoint == CHAT else "completions"
    # Not the openai client: a NaN must reach the server as JSON's NaN, which the client refuses to send.
    request = urllib.request.Request(
        f"{base_url}/{path}", data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as reply:
        urllib.request.urlopen(request, timeout=60)
    assert reply.value.code == 400
    error = json.loads(reply.value.read())["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param + ":") and "Traceback" not in error["message"]
    assert error["type"] == "invalid_request_error"
    stats = get_stats(scheduler_channel)
    assert (stats.num_waiting, stats.num_running, stats.num_blocks_used) == (0, 0, 0)
