"""Generated requests of every field type and edge value through the public API: each one answers
INVALID_ARGUMENT or a valid stream, and the stack stays healthy. `make test` sends 50; the slow suite 1,000."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.stack import get_stats, wait_idle

pytestmark = pytest.mark.timeout(1800)

VOCAB = 49152
U32 = 2**32 - 1
# Streams are read for at most this many messages, then cancelled: a valid request with a huge max_tokens
# costs a few steps, and the cancel exercises the abort path too.
MAX_MESSAGES = 3

floats = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, -1.0, 0.5, 1e-30, 1e30, math.inf, -math.inf, math.nan, 2.0, 100.0]),
    st.floats(width=32, allow_nan=True, allow_infinity=True),
)
u32 = st.one_of(st.sampled_from([0, 1, 2, 16, VOCAB - 1, VOCAB, U32]), st.integers(0, U32))
i32 = st.one_of(st.sampled_from([-(2**31), -2, -1, 0, 1, 50, VOCAB, 2**31 - 1]), st.integers(-(2**31), 2**31 - 1))
token_ids = st.lists(u32, max_size=12)
text = st.text(max_size=80)

sampling = st.builds(
    common_pb2.SamplingParams,
    max_tokens=u32,
    temperature=floats,
    top_p=floats,
    top_k=i32,
    min_p=floats,
    stop=st.lists(text, max_size=3),
    stop_token_ids=token_ids,
    ignore_eos=st.booleans(),
    min_tokens=u32,
    presence_penalty=floats,
    frequency_penalty=floats,
    repetition_penalty=floats,
    logprobs=st.one_of(st.sampled_from([0, 1, 5, 20, 21]), u32),
) | st.just(common_pb2.SamplingParams())


@st.composite
def seeded(draw, params):
    s = draw(params)
    if draw(st.booleans()):
        s.seed = draw(st.one_of(st.sampled_from([0, 1, 2**64 - 1]), st.integers(0, 2**64 - 1)))
    return s


request_ids = st.one_of(st.just(""), text, st.text(max_size=300), st.sampled_from(["\x00", "a\nb", "é" * 200]))
generate = st.builds(
    generate_pb2.GenerateRequest,
    prompt=text,
    prompt_token_ids=token_ids,
    sampling=seeded(sampling),
    request_id=request_ids,
)
roles = st.sampled_from(["user", "system", "assistant", "", "x"])
chat = st.builds(
    generate_pb2.ChatRequest,
    messages=st.lists(st.builds(generate_pb2.ChatMessage, role=roles, content=text), max_size=3),
    sampling=seeded(sampling),
    request_id=request_ids,
)


def answer(stub, request, cancelled_ids: set[str]) -> grpc.StatusCode | None:
    """None for a valid stream (every message well formed), else the status code.

    Ids of streams this test cancelled go into ``cancelled_ids``: a cancelled stream is torn down
    asynchronously, and examples reuse ids (e.g. "é" * 200), so a later request under such an id may
    meet it still live and rightly get ALREADY_EXISTS."""
    method = stub.Chat if isinstance(request, generate_pb2.ChatRequest) else stub.Generate
    call = method(request, timeout=120)
    try:
        for i, response in enumerate(call):
            assert all(0 <= t < VOCAB for t in response.token_ids)
            if response.finish_reason:
                assert response.finish_reason in ("stop", "length", "abort") and response.usage.prompt_tokens > 0
                return None
            if i + 1 >= MAX_MESSAGES:
                call.cancel()
                cancelled_ids.add(request.request_id)
                return None
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and call.cancelled():
            return None
        if e.code() == grpc.StatusCode.ALREADY_EXISTS and request.request_id in cancelled_ids:
            return e.code()
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, e.code(), e.details())
        assert e.details() and "Traceback" not in e.details()
        return e.code()
    raise AssertionError(f"the stream ended without a finish reason: {request}")


def fuzz(channel, scheduler_channel, num_examples: int) -> None:
    stub = generate_pb2_grpc.TextGenerationStub(channel)
    codes: dict[str, int] = {}
    cancelled_ids: set[str] = set()

    @settings(max_examples=num_examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(st.one_of(generate, chat))
    def one(request):
        code = answer(stub, request, cancelled_ids)
        key = "stream" if code is None else code.name
        codes[key] = codes.get(key, 0) + 1

    one()
    print("fuzz answers:", codes)
    stats = wait_idle(scheduler_channel)
    assert (stats.num_running, stats.num_waiting, stats.num_blocks_used) == (0, 0, 0)
    ok = list(stub.Generate(generate_pb2.GenerateRequest(prompt="Hello"), timeout=120))
    assert ok[-1].finish_reason and get_stats(scheduler_channel).worker_ready


def test_fuzzed_requests_answer_invalid_argument_or_a_valid_stream(channel, scheduler_channel):
    fuzz(channel, scheduler_channel, 50)


@pytest.mark.slow
def test_a_thousand_fuzzed_requests(channel, scheduler_channel):
    fuzz(channel, scheduler_channel, 1000)
