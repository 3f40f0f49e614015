"""What the issue's schemathesis run found: integers past what the protobuf fields hold, and lone surrogates in
text, were 500s. Each is a 400 (INVALID_ARGUMENT) naming the field as the client wrote it."""

from __future__ import annotations

import json

import pytest

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.tokenizer import validation as v
from services.tokenizer.frontdoor import ChatPrompt, FrontDoor, TextPrompt
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.limits.conftest import post

pytestmark = pytest.mark.timeout(120)
HI = [{"role": "user", "content": "hi"}]
LONE = "ok \ud800 ok"


def surrogate_body(body: dict) -> bytes:
    """JSON as a client may send it: json.dumps escapes the lone surrogate as \\ud800, which parses back to one."""
    data = json.dumps(body).encode()
    assert b"\\ud800" in data
    return data


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi", "logprobs": 10276798530753910784}, "logprobs"),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
        ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 2**40}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2**32}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
        ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
        ("/v1/completions", {"prompt": "hi", "top_k": 2**31}, "top_k"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 2**32}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, 2**32]}, "stop_token_ids[1]"),
        ("/v1/completions", {"prompt": "hi", "n": 2**63}, "n"),
        ("/v1/completions", {"prompt": [1, 2**32]}, "prompt"),
        ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 2**64}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": 10**400}, "temperature"),
        ("/detokenize", {"tokens": [2**32]}, "tokens[0]"),
    ],
)
def test_integers_out_of_range_are_400_naming_the_field(stack, path, body, param):
    before = len(stack.fake.submits)
    status, reply = post(stack, path, body)
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["message"].startswith(param + ":"), reply
    assert len(stack.fake.submits) == before


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": LONE}, "prompt"),
        ("/v1/completions", {"prompt": ["fine", LONE]}, "prompt[1]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
            "messages[0].content",
        ),
        ("/v1/chat/completions", {"messages": [{"role": LONE, "content": "hi"}]}, "messages[0].role"),
        ("/v1/completions", {"prompt": "hi", "stop": LONE}, "stop"),
        ("/v1/completions", {"prompt": "hi", "stop": ["a", LONE]}, "stop"),
        ("/v1/completions", {"prompt": "hi", "model": LONE}, "model"),
        ("/v1/completions", {"prompt": "hi", "user": LONE}, "user"),
        ("/v1/completions", {"prompt": "hi", "request_id": LONE}, "request_id"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": LONE}}, "structured_outputs.regex"),
        (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"choice": ["a", LONE]}},
            "structured_outputs.choice",
        ),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"grammar": LONE}}, "structured_outputs.grammar"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {"json": LONE}}, "structured_outputs.json"),
        (
            "/v1/completions",
            {"prompt": "hi", "structured_outputs": {"json": {"enum": ["a", LONE]}}},
            "structured_outputs.json",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": HI,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {LONE: 1}}},
            },
            "response_format.json_schema.schema",
        ),
        ("/tokenize", {"prompt": LONE}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
        ("/detokenize", {"tokens": [1], "model": LONE}, "model"),
    ],
)  # fmt: skip
def test_lone_surrogates_are_400_naming_the_field(stack, path, body, param):
    before = len(stack.fake.submits)
    status, reply = post(stack, path, surrogate_body(body))
    assert status == 400, reply
    assert reply["error"]["param"] == param and "not valid Unicode" in reply["error"]["message"], reply
    assert len(stack.fake.submits) == before


def test_the_front_door_refuses_lone_surrogates_for_every_entry_point(smollm):
    """The offline LLM and run-batch hand Python strings to the front door directly."""
    door = FrontDoor(TextTokenizer.from_files(smollm.files), v.ModelLimits(max_model_len=256, vocab_size=49152))
    sampling = common_pb2.SamplingParams()
    with pytest.raises(InvalidArgument) as err:
        door.prepare(TextPrompt(LONE), sampling, "r")
    assert err.value.field == "prompt" and "character 3" in str(err.value)
    chat = ChatPrompt([{"role": "system", "content": "fine"}, {"role": "user", "content": LONE}])
    with pytest.raises(InvalidArgument) as err:
        door.prepare(chat, sampling, "r")
    assert err.value.field == "messages[1].content"
    assert door.prepare(TextPrompt("emoji 😀 and accents é"), sampling, "r").prompt_ids  # real characters pass
