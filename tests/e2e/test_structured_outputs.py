"""Structured outputs on a real `kvgrid serve` with a KV cache small enough to preempt: every output holds to
its JSON schema, regex or choice, on both APIs, greedy and sampled, and a preempted request's output is the
one it gives alone."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
from openai import AsyncOpenAI

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import Stack, collect, get_stats, running_stack, wait_idle

pytestmark = pytest.mark.timeout(900)

# 16 MiB of float32 KV is 22 blocks of 16 tokens: about three of these requests at a time.
ARGS = ["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "species": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "verified": {"type": "boolean"}},
            "required": ["city", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "species", "age", "owner"],
    "additionalProperties": False,
}
PETS = ["a lazy cat", "a loud parrot", "an old dog", "a goldfish", "a kitten", "a puppy", "a canary", "a tabby"]
CITIES = ["Paris", "Lima", "Oslo", "Kyoto", "Cairo"]
PROMPTS = [f"Describe {PETS[i % len(PETS)]} that lives in {CITIES[i % len(CITIES)]}, as JSON." for i in range(20)]
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
MOODS = ["positive", "negative", "neutral"]
REVIEWS = ["I loved it!", "Terrible, never again.", "It was fine.", "Best day ever", "The soup was cold."]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    with running_stack(tmp_path_factory.mktemp("structured") / "serve.log", ARGS) as stack:
        yield stack


@pytest.fixture(scope="module")
def scheduler(stack) -> grpc.Channel:
    with grpc.insecure_channel(stack.scheduler_addr) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(stack) -> generate_pb2_grpc.TextGenerationStub:
    with grpc.insecure_channel(stack.addr) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


def pet_chat(client: AsyncOpenAI, prompt: str, seed: int | None):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=120,
        temperature=0 if seed is None else 0.9,
        seed=seed,
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}},
    )


SIZES = [pytest.param(3, id="3-prompts"), pytest.param(len(PROMPTS), id="20-prompts", marks=pytest.mark.slow)]


@pytest.mark.parametrize("num_prompts", SIZES)
def test_json_schema_holds_for_every_prompt_greedy_and_sampled_through_preemption(stack, scheduler, num_prompts):
    base_url = f"http://127.0.0.1:{stack.ports['--http-port']}/v1"
    prompts = PROMPTS[:num_prompts]
    runs = [(prompt, None) for prompt in prompts] + [(prompt, 100 + i) for i, prompt in enumerate(prompts)]
    # alone: the first greedy and the first seeded run
    probes = [0, num_prompts]

    async def run() -> tuple[list, list]:
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as client:
            together = await asyncio.gather(*(pet_chat(client, p, s) for p, s in runs))
            alone = [await pet_chat(client, *runs[i]) for i in probes]
            return together, alone

    before = get_stats(scheduler)
    together, alone = asyncio.run(run())
    for (prompt, seed), out in zip(runs, together, strict=True):
        choice = out.choices[0]
        assert choice.finish_reason == "stop", (prompt, seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert len({out.choices[0].message.content for out in together}) > num_prompts  # the prompts steer the values
    assert wait_idle(scheduler).num_preemptions > before.num_preemptions
    # greedy and seeded outputs do not depend on the batch or on preemption and recompute
    assert [out.choices[0].message.content for out in alone] == [together[i].choices[0].message.content for i in probes]


def generate(stub, prompt: str, seed: int | None, **constraint) -> tuple[str, list[int], generate_pb2.GenerateResponse]:
    sampling = common_pb2.SamplingParams(max_tokens=40, temperature=0.0 if seed is None else 1.0, **constraint)
    if seed is not None:
        sampling.seed = seed
    return collect(stub.Generate(generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling), timeout=600))


def test_regex_and_choice_hold_on_every_output_of_the_grpc_api(stub, scheduler):
    runs = [(f"The date of event {i} was", dict(regex=DATE)) for i in range(3)]
    choice = common_pb2.Choices(choices=MOODS)
    runs += [(f"Review: {REVIEWS[i]}\nSentiment:", dict(choice=choice)) for i in range(3)]
    seeds = [None, 7]
    with ThreadPoolExecutor(len(runs) * len(seeds)) as pool:
        futures = [(p, c, pool.submit(generate, stub, p, s, **c)) for p, c in runs for s in seeds]
        for prompt, constraint, future in futures:
            text, ids, last = future.result()
            assert last.finish_reason == "stop", (prompt, text)
            if "regex" in constraint:
                assert re.fullmatch(DATE, text), (prompt, text)
            else:
                assert text in MOODS, (prompt, text)
    stats = wait_idle(scheduler)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)


def test_chat_over_grpc_follows_a_grammar(stub):
    grammar = 'start: "The answer is " ANSWER "."\nANSWER: "yes" | "no" | "maybe"'
    sampling = common_pb2.SamplingParams(max_tokens=20, grammar=grammar)
    messages = [generate_pb2.ChatMessage(role="user", content="Is the sea salty?")]
    text, _, last = collect(stub.Chat(generate_pb2.ChatRequest(messages=messages, sampling=sampling), timeout=300))
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", text) and last.finish_reason == "stop"
