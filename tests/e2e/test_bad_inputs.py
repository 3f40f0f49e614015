"""Bad requests through the real stack: exact status code, the field named, nothing left queued."""

from __future__ import annotations

import math

import grpc
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import collect, get_stats

pytestmark = pytest.mark.timeout(300)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
VOCAB = 49152
MAX_MODEL_LEN = 1024  # conftest.FP32_ARGS


def gen(prompt="Hello", ids=(), **sampling) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(
        prompt=prompt, prompt_token_ids=list(ids), sampling=common_pb2.SamplingParams(**sampling)
    )


def chat(*messages: tuple[str, str], **sampling) -> generate_pb2.ChatRequest:
    return generate_pb2.ChatRequest(
        messages=[generate_pb2.ChatMessage(role=r, content=c) for r, c in messages],
        sampling=common_pb2.SamplingParams(**sampling),
    )


CASES = [
    ("no prompt", gen(prompt=""), INVALID, "prompt"),
    ("prompt and ids", gen(ids=[1, 2]), INVALID, "prompt"),
    ("id outside vocab", gen(prompt="", ids=[5, VOCAB]), INVALID, "prompt_token_ids[1]"),
    ("prompt too long", gen(prompt="", ids=[300] * MAX_MODEL_LEN), INVALID, "prompt_token_ids"),
    ("negative temperature", gen(temperature=-0.5), INVALID, "sampling.temperature"),
    ("nan temperature", gen(temperature=math.nan), INVALID, "sampling.temperature"),
    ("top_p above 1", gen(top_p=1.5), INVALID, "sampling.top_p"),
    ("top_k below -1", gen(top_k=-2), INVALID, "sampling.top_k"),
    ("min_p above 1", gen(min_p=1.5), INVALID, "sampling.min_p"),
    ("presence penalty", gen(presence_penalty=2.5), INVALID, "sampling.presence_penalty"),
    ("frequency penalty", gen(frequency_penalty=-3.0), INVALID, "sampling.frequency_penalty"),
    ("repetition penalty", gen(repetition_penalty=-1.0), INVALID, "sampling.repetition_penalty"),
    ("too many logprobs", gen(logprobs=1000), INVALID, "sampling.logprobs"),
    ("max_tokens past the model", gen(max_tokens=MAX_MODEL_LEN + 1), INVALID, "sampling.max_tokens"),
    ("min_tokens over max_tokens", gen(max_tokens=4, min_tokens=9), INVALID, "sampling.min_tokens"),
    ("empty stop string", gen(stop=["ok", ""]), INVALID, "sampling.stop[1]"),
    ("stop token outside vocab", gen(stop_token_ids=[VOCAB + 7]), INVALID, "sampling.stop_token_ids[0]"),
    ("huge request id", generate_pb2.GenerateRequest(prompt="hi", request_id="x" * 1000), INVALID, "request_id"),
    ("no messages", chat(), INVALID, "messages"),
    ("unknown role", chat(("user", "hi"), ("wizard", "abracadabra")), INVALID, "messages[1].role"),
    ("chat bad sampling", chat(("user", "hi"), top_p=-0.1), INVALID, "sampling.top_p"),
]


@pytest.mark.parametrize(("request_", "code", "field"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_rejected_with_its_field(channel, scheduler_channel, request_, code, field):
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    method = stub.Chat if isinstance(request_, generate_pb2.ChatRequest) else stub.Generate
    with pytest.raises(grpc.RpcError) as err:
        collect(method(request_, timeout=60))
    assert err.value.code() == code
    assert err.value.details().startswith(field + ":"), err.value.details()
    assert "Traceback" not in err.value.details()
    stats = get_stats(scheduler_channel)
    assert (stats.num_waiting, stats.num_running, stats.num_blocks_used) == (0, 0, 0)


def test_the_stack_still_answers_after_bad_input(channel):
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    _, ids, last = collect(stub.Generate(gen(prompt="Hello", max_tokens=2, ignore_eos=True), timeout=60))
    assert len(ids) == 2 and last.finish_reason == "length"
