"""One request body, four ways in: HTTP, gRPC (the body translated to kvgrid.v1), the offline ``LLM`` and a
``kvgrid run-batch`` line. All of them go through the frontend's front door, so a valid body gets the same
tokens everywhere and an invalid one the same problem, each API naming the field in its own terms (a batch
line answers exactly what the HTTP route answers).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.e2e.conftest import FP32_ARGS
from tests.e2e.stack import child_env, collect
from tests.e2e.test_offline_parity import llm_options

pytestmark = pytest.mark.timeout(600)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# (url, body, the field each API names when the body is refused: (HTTP and batch, gRPC, offline), or None)
CASES = [
    (COMPLETIONS, {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0, "stop": ["."]}, None),
    (COMPLETIONS, {"prompt": [504, 3575, 282, 4649, 314], "max_tokens": 8, "temperature": 0, "logprobs": 2}, None),
    (COMPLETIONS, {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "seed": 3}, None),
    (CHAT, {"messages": QUESTION, "max_tokens": 12, "temperature": 0}, None),
    (
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 4, "temperature": 500},
        ("temperature", "sampling.temperature", "sampling.temperature"),
    ),
    (
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 5000, "temperature": 0},
        ("max_tokens", "sampling.max_tokens", "sampling.max_tokens"),
    ),
    (
        COMPLETIONS,
        {"prompt": "Hi", "max_tokens": 4, "min_tokens": 9, "temperature": 0},
        ("min_tokens", "sampling.min_tokens", "sampling.min_tokens"),
    ),
    (
        COMPLETIONS,
        {"prompt": [504, 99999], "max_tokens": 4, "temperature": 0},
        ("prompt[1]", "prompt_token_ids[1]", "prompt_token_ids[1]"),
    ),
    (
        CHAT,
        {"messages": [{"role": "robot", "content": "Hi"}], "max_tokens": 4, "temperature": 0},
        ("messages[0].role", "messages[0].role", "messages[0].role"),
    ),
    (COMPLETIONS, {"prompt": "t " * 1100, "max_tokens": 4, "temperature": 0}, ("prompt", "prompt", "prompt")),
]
SAMPLING_FIELDS = ("max_tokens", "temperature", "seed", "stop", "min_tokens", "logprobs")


def sampling_of(body: dict) -> dict:
    return {k: body[k] for k in SAMPLING_FIELDS if k in body}


def grpc_request(url: str, body: dict):
    sampling = common_pb2.SamplingParams(**sampling_of(body))
    if url == CHAT:
        messages = [generate_pb2.ChatMessage(**m) for m in body["messages"]]
        return generate_pb2.ChatRequest(messages=messages, sampling=sampling)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return generate_pb2.GenerateRequest(prompt=prompt, sampling=sampling)
    return generate_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)


def post(base: str, url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        base + url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def answers(fp32_stack, tmp_path_factory) -> list[dict]:
    """Every case through the four doors; per case ``{"http", "batch", "grpc", "offline"}``."""
    base = f"http://127.0.0.1:{fp32_stack.ports['--http-port']}"
    out = [{"http": post(base, url, body)} for url, body, _ in CASES]
    with grpc.insecure_channel(fp32_stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        for answer, (url, body, _) in zip(out, CASES, strict=True):
            request = grpc_request(url, body)
            method = stub.Chat if url == CHAT else stub.Generate
            try:
                answer["grpc"] = collect(method(request, timeout=120))
            except grpc.RpcError as e:
                answer["grpc"] = e
    tmp = tmp_path_factory.mktemp("front-door")
    lines = [
        {"custom_id": f"case-{i}", "method": "POST", "url": url, "body": body} for i, (url, body, _) in enumerate(CASES)
    ]
    (tmp / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    argv = [sys.executable, "-m", "kvgrid.cli", "run-batch", "-i", str(tmp / "in.jsonl"), "-o", str(tmp / "out.jsonl")]
    batch = subprocess.run([*argv, *FP32_ARGS], capture_output=True, text=True, timeout=300, env=child_env())
    assert batch.returncode == 0, batch.stderr[-4000:]
    for answer, line in zip(out, (tmp / "out.jsonl").read_text().splitlines(), strict=True):
        answer["batch"] = json.loads(line)
    requests = [
        ["chat", body["messages"], sampling_of(body)]
        if url == CHAT
        else ["generate", body["prompt"], sampling_of(body)]
        for url, body, _ in CASES
    ]
    spec = {"options": llm_options(FP32_ARGS), "requests": requests}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.e2e.front_door_run"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for answer, result in zip(out, json.loads(proc.stdout), strict=True):
        answer["offline"] = result
    return out


def comparable(body: dict) -> dict:
    """An OpenAI response body without what differs by run: its id, its time, the prefix cache's share."""
    out = {k: v for k, v in body.items() if k not in ("id", "created")}
    out["usage"] = {k: v for k, v in body["usage"].items() if k != "prompt_tokens_details"}
    return out


def assert_same(a, b, where: str = "body") -> None:
    """Equal, but for logprobs: the same float32 model in another batch rounds its last bits differently."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert math.isclose(a, b, abs_tol=1e-4), where
    else:
        assert a == b, where


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[2] is None])
def test_a_valid_body_gets_the_same_tokens_through_every_door(answers, case):
    url, body, _ = CASES[case]
    answer = answers[case]
    status, http = answer["http"]
    assert status == 200, http
    batch = answer["batch"]
    assert batch["error"] is None and batch["response"]["status_code"] == 200
    assert_same(comparable(batch["response"]["body"]), comparable(http))
    choice = http["choices"][0]
    text = choice["message"]["content"] if url == CHAT else choice["text"]
    grpc_text, grpc_ids, last = answer["grpc"]
    offline = answer["offline"]
    assert grpc_text == offline["text"] == text
    assert grpc_ids == offline["token_ids"]
    assert len(grpc_ids) == http["usage"]["completion_tokens"] == last.usage.completion_tokens
    assert last.usage.prompt_tokens == offline["num_prompt_tokens"] == http["usage"]["prompt_tokens"]
    assert last.finish_reason == offline["finish_reason"] == choice["finish_reason"]


@pytest.mark.parametrize("case", [i for i, c in enumerate(CASES) if c[2] is not None])
def test_an_invalid_body_gets_the_same_problem_through_every_door(answers, case):
    _, _, (http_field, grpc_field, offline_field) = CASES[case]
    answer = answers[case]
    status, http = answer["http"]
    assert status == 400, http
    message = http["error"]["message"]
    assert http["error"]["param"] == http_field and message.startswith(f"{http_field}: ")
    problem = message.removeprefix(f"{http_field}: ")
    batch = answer["batch"]
    assert batch["response"] == {"status_code": 400, "request_id": None, "body": http}
    assert batch["error"] == {"code": http["error"]["code"], "message": message}
    error = answer["grpc"]
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details() == f"{grpc_field}: {problem}"
    # SamplingParams checks its own ranges when built, before there is a prompt to name.
    assert answer["offline"]["error"].removeprefix("prompt 0: ") == f"{offline_field}: {problem}"


def test_a_field_kvgrid_knows_and_does_not_support_is_refused_by_name(fp32_stack):
    base = f"http://127.0.0.1:{fp32_stack.ports['--http-port']}"
    status, body = post(base, CHAT, {"messages": QUESTION, "continue_final_message": True})
    assert status == 400 and body["error"]["param"] == "continue_final_message", body
    assert body["error"]["message"] == (
        "continue_final_message: not supported by kvgrid (continuing the final message)"
    )
    # A request's own chat template: served only by a server started with --trust-request-chat-template.
    status, body = post(base, CHAT, {"messages": QUESTION, "chat_template": "{{ messages }}"})
    assert status == 400 and body["error"]["param"] == "chat_template", body
    assert "--trust-request-chat-template" in body["error"]["message"]
    status, body = post(base, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "logit_bias": {"50": 10}})
    assert status == 400 and body["error"]["param"] == "logit_bias", body
    # The values that mean "off" pass, and unknown fields stay ignored, as OpenAI's server does.
    status, body = post(base, CHAT, {"messages": QUESTION, "max_tokens": 2, "chat_template_kwargs": {}})
    assert status == 200, body
    status, body = post(base, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2, "no_such_field": 1})
    assert status == 200, body
