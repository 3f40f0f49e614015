"""kvgrid.v1.TextGeneration over real gRPC, in front of a fake scheduler that plays scripted tokens."""

from __future__ import annotations

import random
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import common_pb2, generate_pb2
from tests.tokenizer.conftest import MAX_MODEL_LEN, VOCAB_SIZE, generate, joined, wait_until
from tests.tokenizer.fake_scheduler import Script

pytestmark = pytest.mark.timeout(120)
STOP, LENGTH, ABORT = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_ABORT


def chunked(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        out.append(ids[i : i + n])
        i += n
    return out


def metric(stack, name: str, labels: str = "") -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{stack.frontend.http_port}/metrics", timeout=5).read().decode()
    pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", re.M)
    return sum(float(value) for found, value in pattern.findall(body) if labels in found)


def test_model_info_comes_from_the_worker_handshake(stack):
    info = stack.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=5)
    assert (info.model, info.max_model_len, info.vocab_size) == ("SmolLM2-135M-Instruct", MAX_MODEL_LEN, VOCAB_SIZE)
    assert (info.num_kv_blocks, info.block_size, info.dtype, info.device) == (123, 16, "float32", "cpu")
    assert list(info.eos_token_ids) == [2]


def test_generate_streams_multilingual_text_without_broken_characters(stack, smollm):
    rng = random.Random(0)
    for _ in range(5):
        expected = "Réponse: 你好 🎉👍🏽 wörld — ok"
        ids = smollm.hf(expected, add_special_tokens=False)["input_ids"]
        deltas = chunked(ids, rng)
        stack.fake.script = Script(deltas=deltas, finish=LENGTH, num_cached_tokens=3)
        responses = generate(stack, prompt="Say hello ✨", request_id="multi-1")
        text, token_ids = joined(responses)
        assert text == expected and token_ids == ids
        assert not any("\ufffd" in r.text for r in responses)
        assert [r.finish_reason for r in responses] == [""] * (len(responses) - 1) + ["length"]
        assert all(r.request_id == "multi-1" for r in responses)
        prompt_ids = smollm.hf("Say hello ✨")["input_ids"]
        usage = responses[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (
            len(prompt_ids),
            len(ids),
            3,
        )
        submitted = stack.fake.submits[-1]
        assert list(submitted.prompt_token_ids) == prompt_ids
        assert submitted.request_id == "multi-1"
        assert submitted.sampling.max_tokens == 16  # 0 means 16, sent explicitly


def test_generated_request_id_and_prompt_token_ids(stack, smollm):
    ids = smollm.hf(" Paris.", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[ids], finish=STOP)
    responses = generate(stack, prompt_token_ids=[504, 3575, 282], sampling=common_pb2.SamplingParams(max_tokens=5))
    assert joined(responses) == (" Paris.", ids)
    assert responses[-1].finish_reason == "stop"
    assert len(responses[-1].request_id) == 32 and stack.fake.submits[-1].request_id == responses[-1].request_id
    assert list(stack.fake.submits[-1].prompt_token_ids) == [504, 3575, 282]


@pytest.mark.parametrize("include", [False, True])
def test_special_tokens_skipped_unless_asked(stack, smollm, include):
    ids = smollm.hf("Sure!<|im_end|>", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], finish=STOP)
    sampling = common_pb2.SamplingParams(include_special_tokens=include)
    text, _ = joined(generate(stack, prompt="hi", sampling=sampling))
    assert text == ("Sure!<|im_end|>" if include else "Sure!")


def test_chat_uses_the_models_chat_template(stack, smollm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Capital of France?"},
    ]
    stack.fake.script = Script(deltas=[smollm.hf("Paris", add_special_tokens=False)["input_ids"]], finish=STOP)
    request = generate_pb2.ChatRequest(messages=[generate_pb2.ChatMessage(**m) for m in messages])
    responses = list(stack.stub.Chat(request, timeout=30))
    assert joined(responses)[0] == "Paris" and responses[-1].finish_reason == "stop"
    expected = smollm.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(stack.fake.submits[-1].prompt_token_ids) == expected
    assert responses[-1].usage.prompt_tokens == len(expected)


def test_concurrent_streams_keep_their_own_text(stack, smollm):
    rng = random.Random(7)
    expected = {f"conc-{i}": f"Stream {i}: " + "🎉你好é"[i % 4 :] * (i % 5 + 1) for i in range(16)}
    for request_id, text in expected.items():
        ids = smollm.hf(text, add_special_tokens=False)["input_ids"]
        stack.fake.scripts[request_id] = Script(deltas=chunked(ids, rng), finish=STOP, delay_s=0.002)
    with ThreadPoolExecutor(max_workers=16) as pool:
        results = pool.map(lambda rid: (rid, joined(generate(stack, prompt="go", request_id=rid))[0]), expected)
        assert dict(results) == expected


def test_tokenize_and_detokenize_match_transformers(stack, smollm):
    for text in ["Hello, world!", "héllo 你好 🎉", "<|im_start|>user", "long 🎉 text " * 1000]:
        for add in (False, True):
            reply = stack.stub.Tokenize(generate_pb2.TokenizeRequest(text=text, add_special_tokens=add), timeout=5)
            ids = smollm.hf(text, add_special_tokens=add)["input_ids"]
            assert list(reply.token_ids) == ids
            assert list(reply.tokens) == smollm.hf.convert_ids_to_tokens(ids)
            for keep in (False, True):
                request = generate_pb2.DetokenizeRequest(token_ids=ids, include_special_tokens=keep)
                assert stack.stub.Detokenize(request, timeout=5).text == smollm.hf.decode(
                    ids, skip_special_tokens=not keep
                )
    messages = [{"role": "user", "content": "hi"}]
    request = generate_pb2.TokenizeRequest(messages=[generate_pb2.ChatMessage(**m) for m in messages])
    expected = smollm.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(stack.stub.Tokenize(request, timeout=5).token_ids) == expected


def test_logprobs_carry_token_strings(stack, smollm):
    ids = smollm.hf("Hi there", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[ids], finish=LENGTH, logprobs=True)
    responses = generate(stack, prompt="x", sampling=common_pb2.SamplingParams(logprobs=2))
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == ids
    assert [lp.token for lp in logprobs] == [smollm.hf.decode([i]) for i in ids]
    assert [t.token for t in logprobs[0].top] == [smollm.hf.decode([ids[0]]), smollm.hf.decode([ids[0] + 1])]


def test_output_is_capped_to_the_model_length(stack):
    stack.fake.script = Script(deltas=[[42]], finish=LENGTH)
    prompt = list(range(100, 100 + MAX_MODEL_LEN - 10))
    sampling = common_pb2.SamplingParams(max_tokens=100, min_tokens=50)
    responses = generate(stack, prompt_token_ids=prompt, sampling=sampling)
    assert responses[-1].finish_reason == "length"
    assert stack.fake.submits[-1].sampling.max_tokens == 10
    assert stack.fake.submits[-1].sampling.min_tokens == 10


S = common_pb2.SamplingParams
M = generate_pb2.ChatMessage
NAN = float("nan")
BAD_GENERATE = [
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", prompt_token_ids=[1, 2]), "prompt"),
    (dict(prompt_token_ids=[1, VOCAB_SIZE]), "prompt_token_ids[1]"),
    (dict(prompt="hi", sampling=S(temperature=-0.5)), "sampling.temperature"),
    (dict(prompt="hi", sampling=S(temperature=101)), "sampling.temperature"),
    (dict(prompt="hi", sampling=S(temperature=NAN)), "sampling.temperature"),
    (dict(prompt="hi", sampling=S(top_p=1.5)), "sampling.top_p"),
    (dict(prompt="hi", sampling=S(top_p=-0.1)), "sampling.top_p"),
    (dict(prompt="hi", sampling=S(top_k=-2)), "sampling.top_k"),
    (dict(prompt="hi", sampling=S(top_k=VOCAB_SIZE + 1)), "sampling.top_k"),
    (dict(prompt="hi", sampling=S(min_p=1.5)), "sampling.min_p"),
    (dict(prompt="hi", sampling=S(min_p=-0.5)), "sampling.min_p"),
    (dict(prompt="hi", sampling=S(presence_penalty=2.5)), "sampling.presence_penalty"),
    (dict(prompt="hi", sampling=S(frequency_penalty=-3)), "sampling.frequency_penalty"),
    (dict(prompt="hi", sampling=S(repetition_penalty=-1)), "sampling.repetition_penalty"),
    (dict(prompt="hi", sampling=S(logprobs=21)), "sampling.logprobs"),
    (dict(prompt="hi", sampling=S(max_tokens=MAX_MODEL_LEN + 1)), "sampling.max_tokens"),
    (dict(prompt="hi", sampling=S(max_tokens=5, min_tokens=6)), "sampling.min_tokens"),
    (dict(prompt="hi", sampling=S(min_tokens=17)), "sampling.min_tokens"),  # max_tokens 0 means 16
    (dict(prompt="hi", sampling=S(stop=["x"] * 17)), "sampling.stop"),
    (dict(prompt="hi", sampling=S(stop=["ok", ""])), "sampling.stop[1]"),
    (dict(prompt="hi", sampling=S(stop=["y" * 257])), "sampling.stop[0]"),
    (dict(prompt="hi", sampling=S(stop_token_ids=[VOCAB_SIZE])), "sampling.stop_token_ids[0]"),
    (dict(prompt="hi", request_id="x" * 300), "request_id"),
    (dict(prompt="hi", request_id="a\nb"), "request_id"),
    (dict(prompt_token_ids=list(range(MAX_MODEL_LEN))), "prompt_token_ids"),
    (dict(prompt="word " * MAX_MODEL_LEN), "prompt"),
    (dict(prompt="wörd " * 2000), "prompt"),  # long enough to be tokenized off the event loop
    (dict(prompt="hi", sampling=S(json_schema="{oops")), "sampling.json_schema"),
    (dict(prompt="hi", sampling=S(json_schema='{"type": "wizard"}')), "sampling.json_schema"),
    (dict(prompt="hi", sampling=S(json_schema="[1, 2]")), "sampling.json_schema"),
    (dict(prompt="hi", sampling=S(regex="a[")), "sampling.regex"),
    (dict(prompt="hi", sampling=S(regex="")), "sampling.regex"),
    (dict(prompt="hi", sampling=S(choice=common_pb2.Choices())), "sampling.choice"),
    (dict(prompt="hi", sampling=S(choice=common_pb2.Choices(choices=["a", ""]))), "sampling.choice[1]"),
    (dict(prompt="hi", sampling=S(grammar="start: undefined_rule")), "sampling.grammar"),
    (dict(prompt="hi", sampling=S(grammar="root ::= ((")), "sampling.grammar"),
    (dict(prompt="hi", sampling=S(grammar='start: "a" <|no_such_token|>')), "sampling.grammar"),  # vocabulary
    (dict(prompt="hi", sampling=S(json_object=False)), "sampling.json_object"),
    (dict(prompt="hi", sampling=S(regex="a+", ignore_eos=True)), "sampling.ignore_eos"),
    (dict(prompt="hi", sampling=S(regex="a+", min_tokens=2)), "sampling.min_tokens"),
]
BAD_CHAT = [
    (dict(messages=[]), "messages"),
    (dict(messages=[M(role="user", content="a"), M(role="robot", content="b")]), "messages[1].role"),
    (dict(messages=[M(role="user", content="a")], sampling=S(top_p=2)), "sampling.top_p"),
    (dict(messages=[M(role="user", content="word " * MAX_MODEL_LEN)]), "messages"),
]


@pytest.mark.parametrize("fields, field", BAD_GENERATE, ids=[f for _, f in BAD_GENERATE])
def test_bad_generate_requests_are_invalid_argument_naming_the_field(stack, fields, field):
    before = len(stack.fake.submits)
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    assert len(stack.fake.submits) == before


@pytest.mark.parametrize("fields, field", BAD_CHAT, ids=[f for _, f in BAD_CHAT])
def test_bad_chat_requests_are_invalid_argument_naming_the_field(stack, fields, field):
    before = len(stack.fake.submits)
    with pytest.raises(grpc.RpcError) as err:
        list(stack.stub.Chat(generate_pb2.ChatRequest(**fields), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field + ":"), err.value.details()
    assert len(stack.fake.submits) == before


def test_a_structured_output_reaches_the_scheduler_as_given(stack):
    schema = '{"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}'
    generate(stack, prompt="hi", sampling=S(json_schema=schema))
    assert stack.fake.submits[-1].sampling.json_schema == schema
    generate(stack, prompt="hi", sampling=S(choice=common_pb2.Choices(choices=["yes", "no"])))
    assert list(stack.fake.submits[-1].sampling.choice.choices) == ["yes", "no"]


def test_a_grammar_naming_a_special_token_of_the_vocabulary_is_accepted(stack):
    generate(stack, prompt="hi", sampling=S(grammar='start: "a" <|im_end|>'))
    assert stack.fake.submits[-1].sampling.grammar == 'start: "a" <|im_end|>'


def test_too_long_prompt_names_both_numbers(stack):
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, prompt_token_ids=[5] * 300)
    assert "300" in err.value.details() and str(MAX_MODEL_LEN) in err.value.details()


def test_bad_tokenize_and_detokenize(stack):
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Detokenize(generate_pb2.DetokenizeRequest(token_ids=[1, 10**6]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("token_ids[1]")
    with pytest.raises(grpc.RpcError) as err:
        stack.stub.Tokenize(generate_pb2.TokenizeRequest(messages=[M(role="nobody", content="x")]), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("messages[0].role")


@pytest.mark.parametrize("code", [grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ALREADY_EXISTS])
def test_scheduler_errors_pass_through_with_their_code(stack, code):
    stack.fake.script = Script(error=code)
    with pytest.raises(grpc.RpcError) as err:
        generate(stack, prompt="hi")
    assert err.value.code() == code
    assert err.value.details().startswith("scheduler at 127.0.0.1:") and code.name in err.value.details()


def test_client_cancel_aborts_the_request_upstream(stack, smollm):
    ids = smollm.hf("one two three", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], hang=True)
    call = stack.stub.Generate(generate_pb2.GenerateRequest(prompt="count", request_id="cancel-1"), timeout=30)
    first = next(call)
    assert first.token_ids
    call.cancel()
    wait_until(lambda: "cancel-1" in stack.fake.aborts, what="Abort at the scheduler")
    wait_until(lambda: "cancel-1" in stack.fake.cancelled, what="the scheduler to stop the request")


def test_trace_context_reaches_the_scheduler(stack):
    stack.fake.script = Script(deltas=[[42]], finish=LENGTH)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    metadata = [("traceparent", f"00-{trace_id}-00f067aa0ba902b7-01")]
    list(stack.stub.Generate(generate_pb2.GenerateRequest(prompt="hi"), metadata=metadata, timeout=30))
    assert trace_id in stack.fake.submits[-1].trace_context.get("traceparent", "")


def test_metrics_count_requests_and_tokens(stack, smollm):
    ids = smollm.hf("a b c d", add_special_tokens=False)["input_ids"]
    before = {
        "stop": metric(stack, "kvgrid_requests_total", 'status="stop"'),
        "invalid": metric(stack, "kvgrid_requests_total", 'status="invalid_argument"'),
        "gen": metric(stack, "kvgrid_generation_tokens_total"),
        "prompt": metric(stack, "kvgrid_prompt_tokens_total"),
        "ttft": metric(stack, "kvgrid_time_to_first_token_seconds_count"),
        "itl": metric(stack, "kvgrid_inter_token_latency_seconds_count"),
        "e2e": metric(stack, "kvgrid_e2e_request_latency_seconds_count"),
    }
    stack.fake.script = Script(deltas=[[t] for t in ids], finish=STOP)
    # Deltas that pile up while the call waits go out as one response; inter-token latency counts every token
    # after the first response's.
    first = next(r for r in generate(stack, prompt_token_ids=[7, 8, 9]) if r.token_ids)
    with pytest.raises(grpc.RpcError):
        generate(stack, prompt="")
    assert metric(stack, "kvgrid_requests_total", 'status="stop"') == before["stop"] + 1
    assert metric(stack, "kvgrid_requests_total", 'status="invalid_argument"') == before["invalid"] + 1
    assert metric(stack, "kvgrid_generation_tokens_total") == before["gen"] + len(ids)
    assert metric(stack, "kvgrid_prompt_tokens_total") == before["prompt"] + 3
    assert metric(stack, "kvgrid_time_to_first_token_seconds_count") == before["ttft"] + 1
    assert metric(stack, "kvgrid_inter_token_latency_seconds_count") == before["itl"] + len(ids) - len(first.token_ids)
    assert metric(stack, "kvgrid_e2e_request_latency_seconds_count") == before["e2e"] + 1


def test_health_follows_the_scheduler(stack):
    health = health_pb2_grpc.HealthStub(stack.channel)
    url = f"http://127.0.0.1:{stack.frontend.http_port}/health"
    check = health_pb2.HealthCheckRequest(service="kvgrid.v1.TextGeneration")
    assert health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    assert urllib.request.urlopen(url, timeout=5).status == 200
    try:
        stack.loop.loop.call_soon_threadsafe(stack.scheduler_health.set, False)
        wait_until(lambda: health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=5)
        assert err.value.code == 503
        with pytest.raises(grpc.RpcError) as rpc_err:
            generate(stack, prompt="hi")
        assert rpc_err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not serving" in rpc_err.value.details()
    finally:
        stack.loop.loop.call_soon_threadsafe(stack.scheduler_health.set, True)
        wait_until(lambda: health.Check(check, timeout=5).status == health_pb2.HealthCheckResponse.SERVING)
    assert generate(stack, prompt="hi")[-1].finish_reason


def test_http_health_and_metrics_answer_get_and_head_only(stack):
    base = f"http://127.0.0.1:{stack.frontend.http_port}"
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{base}/no/such/page", timeout=5)
    assert err.value.code == 404
    head = urllib.request.urlopen(urllib.request.Request(f"{base}/health", method="HEAD"), timeout=5)
    assert head.status == 200 and head.read() == b""
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(f"{base}/metrics", data=b"x", method="POST"), timeout=5)
    assert err.value.code == 405
