"""The prompt-length cap: checked in characters before anything is tokenized, on every entry point (gRPC
Generate, Chat and Tokenize, the OpenAI routes, /tokenize, the front door the offline LLM uses), fast, and
without holding up another client's stream."""

from __future__ import annotations

import random
import string
import time

import grpc
import pytest

from kvgrid.v1 import generate_pb2, worker_pb2
from services.common.errors import InvalidArgument
from services.tokenizer import validation as v
from services.tokenizer.frontdoor import ChatPrompt, FrontDoor, TextPrompt, tokenize
from services.tokenizer.model_state import ModelState
from tests.limits.conftest import MAX_MODEL_LEN, post

pytestmark = pytest.mark.timeout(300)
TEN_MILLION = 10_000_000
REFUSED_WITHIN_S = 1.0


def _grpc_refusal(call, request) -> tuple[grpc.StatusCode, str, float]:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        result = call(request, timeout=60)
        for _ in result if not hasattr(result, "token_ids") else ():
            pass
    return err.value.code(), err.value.details(), time.monotonic() - start


def test_ten_million_characters_are_refused_before_tokenizing_on_every_api(stack, neighbour):
    big = "a" * TEN_MILLION  # a single word: the slowest kind of text to tokenize
    cap = v.MAX_CHARS_PER_TOKEN * MAX_MODEL_LEN
    messages = [generate_pb2.ChatMessage(role="user", content=big)]
    grpc_cases = [
        (stack.stub.Generate, generate_pb2.GenerateRequest(prompt=big), "prompt"),
        (stack.stub.Chat, generate_pb2.ChatRequest(messages=messages), "messages"),
        (stack.stub.Tokenize, generate_pb2.TokenizeRequest(text=big), "text"),
        (stack.stub.Tokenize, generate_pb2.TokenizeRequest(messages=messages), "messages"),
    ]
    for call, request, field in grpc_cases:
        code, details, took = _grpc_refusal(call, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(f"{field}: "), details
        assert f"{TEN_MILLION} characters" in details and took < REFUSED_WITHIN_S, (details, took)
        print(f"gRPC {type(request).__name__}: refused in {took:.3f}s")
    assert str(cap) in _grpc_refusal(stack.stub.Generate, grpc_cases[0][1])[1]  # the model's own cap
    half = [{"role": "user", "content": big[: TEN_MILLION // 2]}, {"role": "user", "content": big[: TEN_MILLION // 2]}]
    http_cases = [
        ("/v1/completions", {"prompt": big}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", big]}, "prompt[1]"),
        ("/v1/chat/completions", {"messages": half}, "messages"),  # the contents together
        ("/tokenize", {"prompt": big}, "prompt"),
        ("/tokenize", {"messages": half}, "messages"),
    ]
    for path, body, param in http_cases:
        start = time.monotonic()
        status, reply = post(stack, path, body)
        took = time.monotonic() - start
        assert status == 400 and reply["error"]["param"] == param, (path, reply)
        assert took < REFUSED_WITHIN_S, (path, took)
        print(f"HTTP {path} {param}: refused in {took:.3f}s")
    gap = neighbour.finish(busy_until=time.monotonic())
    print(f"the neighbour's largest gap: {gap:.3f}s")
    assert gap < REFUSED_WITHIN_S


def test_sixty_megabytes_in_one_word_are_refused_quickly_while_another_stream_runs(stack, neighbour):
    """The issue's reproduction: one such gRPC Generate froze the frontend for minutes. The message and body
    size limits (--max-request-bytes) refuse it before it is parsed."""
    word = "a" * (60 * 2**20)
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Generate(generate_pb2.GenerateRequest(prompt=word), timeout=60))
    assert err.value.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INVALID_ARGUMENT)
    grpc_took = time.monotonic() - start
    start = time.monotonic()
    try:
        status, _ = post(stack, "/v1/completions", b'{"prompt": "' + word.encode() + b'"}')
    except (BrokenPipeError, ConnectionResetError):  # refused (413) before the whole body was sent
        status = 413
    http_took = time.monotonic() - start
    busy_until = time.monotonic()
    assert status in (400, 413)
    assert grpc_took < 5 and http_took < 5, (grpc_took, http_took)
    assert post(stack, "/tokenize", {"prompt": "still here"})[0] == 200
    gap = neighbour.finish(busy_until)
    print(f"60 MB: gRPC refused in {grpc_took:.3f}s, HTTP ({status}) in {http_took:.3f}s; neighbour's gap {gap:.3f}s")
    assert gap < 2.0


def test_a_prompt_at_the_cap_is_tokenized_without_holding_up_another_stream(stack, neighbour):
    """The longest prompt the cap lets through is tokenized (then refused: far more tokens than the model
    takes) off the event loop; the other stream's tokens keep coming meanwhile."""
    cap = v.MAX_CHARS_PER_TOKEN * MAX_MODEL_LEN
    rng = random.Random(0)
    text = "".join(rng.choices(string.ascii_letters + " ", k=cap))
    start = time.monotonic()
    code, details, _ = _grpc_refusal(stack.stub.Generate, generate_pb2.GenerateRequest(prompt=text))
    took = time.monotonic() - start
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokens" in details and "characters" not in details
    gap = neighbour.finish(busy_until=time.monotonic())
    print(f"tokenizing {cap} characters took {took:.2f}s; the neighbour's largest gap {gap:.3f}s")
    assert gap < max(0.1, took / 3)  # a loop held for the whole tokenization would show a gap of about `took`


class ExplodingTokenizer:
    """Fails the test if anything is tokenized."""

    chat_template = object()
    vocab_size = 100

    def encode(self, text, add_special_tokens=True):
        raise AssertionError("tokenized")

    def encode_chat(self, messages):
        raise AssertionError("tokenized")


def test_the_front_door_refuses_past_the_configured_cap_without_tokenizing():
    limits = v.ModelLimits(max_model_len=64, vocab_size=100, max_prompt_chars=10)
    door = FrontDoor(ExplodingTokenizer(), limits)
    sampling = generate_pb2.GenerateRequest().sampling
    with pytest.raises(InvalidArgument) as err:
        door.prepare(TextPrompt("x" * 11), sampling, "r")
    assert err.value.field == "prompt" and "11 characters; at most 10" in str(err.value)
    chat = ChatPrompt([{"role": "system", "content": "x" * 6}, {"role": "user", "content": "y" * 5}])
    with pytest.raises(InvalidArgument) as err:
        door.prepare(chat, sampling, "r")
    assert err.value.field == "messages" and "11 characters" in str(err.value)
    with pytest.raises(AssertionError, match="tokenized"):  # at the cap: tokenized
        door.prepare(TextPrompt("x" * 10), sampling, "r")
    with pytest.raises(InvalidArgument):  # tokenize() alone (/tokenize, gRPC Tokenize) takes a cap too
        tokenize(ExplodingTokenizer(), TextPrompt("x" * 11), max_chars=10)
    assert v.ModelLimits(max_model_len=8192, vocab_size=1).max_prompt_chars == 128 * 8192  # 0: auto


def test_model_state_hands_the_configured_cap_to_every_front_door(smollm):
    from services.tokenizer.text_tokenizer import TextTokenizer

    info = worker_pb2.HandshakeResponse(max_model_len=512, vocab_size=49152)
    state = ModelState("sched", tokenizer=TextTokenizer.from_files(smollm.files), max_prompt_chars=1000)
    state.info = info
    assert state.limits().max_prompt_chars == 1000
    state = ModelState("sched", tokenizer=state.tokenizer)
    state.info = info
    assert state.limits().max_prompt_chars == v.MAX_CHARS_PER_TOKEN * 512
