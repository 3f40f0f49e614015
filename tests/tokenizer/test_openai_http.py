"""The frontend's HTTP app over real HTTP, in front of a fake scheduler: SSE framing, error statuses, aborts."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request

import grpc
import pytest

from kvgrid.v1 import common_pb2
from tests.tokenizer.conftest import MAX_MODEL_LEN, wait_until
from tests.tokenizer.fake_scheduler import Script

pytestmark = pytest.mark.timeout(120)
STOP = common_pb2.FINISH_REASON_STOP


def post(stack, path: str, body: dict, timeout: float = 30) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{stack.frontend.http_port}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            raw = reply.read().decode()
            is_json = reply.headers.get_content_type() == "application/json"
            return reply.status, json.loads(raw) if is_json else raw
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def events(sse: str) -> list[str]:
    assert sse.endswith("\n\n")
    blocks = sse.split("\n\n")[:-1]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b[len("data: ") :] for b in blocks]


def test_completion_text_ids_and_usage(stack, smollm):
    ids = smollm.hf(" blue and green", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], finish=STOP, num_cached_tokens=2)
    status, body = post(stack, "/v1/completions", {"prompt": "Colors:", "max_tokens": 9})
    assert status == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"] == [{"index": 0, "text": " blue and green", "logprobs": None, "finish_reason": "stop"}]
    prompt_tokens = len(smollm.hf("Colors:")["input_ids"])
    assert body["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": len(ids),
        "total_tokens": prompt_tokens + len(ids),
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    submitted = stack.fake.submits[-1].sampling
    assert submitted.max_tokens == 9 and submitted.temperature == 1.0  # OpenAI samples by default


@pytest.mark.parametrize(
    ("extra", "at_finish"),
    [({}, True), ({"stop": ["zz"]}, False), ({"stream": True}, False)],
    ids=["answered-once", "stop-strings", "streamed"],
)
def test_the_scheduler_holds_the_tokens_of_a_completion_answered_once_without_stop_strings(
    stack, smollm, extra, at_finish
):
    """Stop strings are matched here as the tokens come, and a stream sends them as they come."""
    ids = smollm.hf(" blue and green", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], finish=STOP)
    status, body = post(stack, "/v1/completions", {"prompt": "Colors:", "max_tokens": 9, **extra})
    assert status == 200 and stack.fake.submits[-1].deliver_at_finish is at_finish
    text = (
        body["choices"][0]["text"]
        if isinstance(body, dict)
        else "".join(json.loads(d)["choices"][0]["text"] for d in events(body)[:-1] if json.loads(d)["choices"])
    )
    assert text == " blue and green"


def test_sse_stream_ends_with_usage_and_done(stack, smollm):
    ids = smollm.hf(" one two three", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], finish=STOP)
    messages = [{"role": "user", "content": "count"}]
    body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
    status, sse = post(stack, "/v1/chat/completions", body)
    data = events(sse)
    assert status == 200 and data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == " one two three"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(ids)


def test_echo_and_completion_logprobs(stack, smollm):
    ids = smollm.hf(" sky", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[ids], finish=STOP, logprobs=True)
    status, body = post(stack, "/v1/completions", {"prompt": "Blue", "echo": True})
    assert status == 200 and body["choices"][0]["text"] == "Blue sky"
    status, body = post(stack, "/v1/completions", {"prompt": "Blue", "logprobs": 1})
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == [smollm.hf.decode([t]) for t in ids] and lp["token_logprobs"] == [-0.5] * len(ids)
    assert all(len(top) == 1 for top in lp["top_logprobs"]) and lp["text_offset"][0] == 0
    assert stack.fake.submits[-1].sampling.logprobs == 1
    status, body = post(stack, "/v1/completions", {"prompt": "Blue", "logprobs": 1, "echo": True})
    assert status == 200 and stack.fake.submits[-1].sampling.prompt_logprobs == 1  # the echoed prompt is scored
    lp = body["choices"][0]["logprobs"]  # the fake scheduler scores nothing: the prompt's one token leads
    assert lp["tokens"][0] == "Blue" and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == [-0.5] * len(ids)


def test_n_choices_and_several_prompts_each_get_their_own_request(stack):
    stack.fake.script = Script(deltas=[[42]], finish=STOP)
    before = len(stack.fake.submits)
    status, body = post(stack, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "seed": 5, "request_id": "pair"})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    submits = {s.request_id: s for s in stack.fake.submits[before:]}
    assert sorted(submits) == ["pair-0", "pair-1", "pair-2", "pair-3"]
    assert [submits[f"pair-{i}"].sampling.seed for i in range(4)] == [5, 6, 5, 6]  # seed + sample index


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.ALREADY_EXISTS, 409),
    ],
)
def test_scheduler_errors_become_http_statuses(stack, code, status):
    stack.fake.script = Script(error=code)
    for stream in (False, True):
        got, body = post(stack, "/v1/completions", {"prompt": "hi", "stream": stream})
        assert got == status and body["error"]["code"] == code.name.lower()
        assert code.name in body["error"]["message"] and "Traceback" not in body["error"]["message"]


def test_bad_fields_are_400_with_the_openai_error_object(stack):
    hi = [{"role": "user", "content": "hi"}]
    cases = [
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("/v1/chat/completions", {"messages": hi, "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": hi, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": hi, "max_completion_tokens": 999}, "max_completion_tokens"),
        (
            "/v1/chat/completions",
            {"messages": hi, "structured_outputs": {"regex": "a", "choice": ["b"]}},
            "structured_outputs",
        ),  # fmt: skip
    ]
    before = len(stack.fake.submits)
    for path, body, param in cases:
        status, reply = post(stack, path, body)
        assert status == 400, (body, reply)
        assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error", reply
        assert reply["error"]["message"].startswith(param + ":"), reply
    assert len(stack.fake.submits) == before


def test_unknown_model_404_and_not_serving_503(stack):
    status, body = post(stack, "/v1/completions", {"prompt": "hi", "model": "nope"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    try:
        stack.loop.loop.call_soon_threadsafe(stack.scheduler_health.set, False)
        wait_until(lambda: not stack.frontend.state.serving)
        status, body = post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and body["error"]["type"] == "service_unavailable"
    finally:
        stack.loop.loop.call_soon_threadsafe(stack.scheduler_health.set, True)
        wait_until(lambda: stack.frontend.state.serving)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_aborts_the_request_upstream(stack, stream):
    rid = f"gone-{stream}"
    stack.fake.script = Script(deltas=[[42]], hang=True)
    conn = http.client.HTTPConnection("127.0.0.1", stack.frontend.http_port, timeout=30)
    body = json.dumps({"prompt": "hi", "stream": stream, "request_id": rid})
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    if stream:
        reply = conn.getresponse()
        assert reply.status == 200 and reply.readline().startswith(b"data: ")
    else:
        wait_until(lambda: any(s.request_id == rid for s in stack.fake.submits), what="the submit")
    conn.sock.close()
    conn.close()
    wait_until(lambda: rid in stack.fake.aborts, what="Abort at the scheduler")
    wait_until(lambda: rid in stack.fake.cancelled, what="the Submit call to be cancelled")


def test_tokenize_and_detokenize(stack, smollm):
    status, body = post(stack, "/tokenize", {"prompt": "Hello world"})
    expected = smollm.hf("Hello world")["input_ids"]
    assert status == 200 and body == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected}
    status, body = post(stack, "/detokenize", {"tokens": expected})
    assert status == 200 and body == {"prompt": "Hello world"}
    status, body = post(stack, "/detokenize", {"tokens": [1, 10**6]})
    assert status == 400 and body["error"]["param"] == "tokens[1]"
    messages = [{"role": "user", "content": "hi"}]
    status, body = post(stack, "/tokenize", {"messages": messages})
    expected = smollm.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert body["tokens"] == expected
