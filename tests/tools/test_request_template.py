"""A chat request's own template (vLLM's ``chat_template``) and template variables (``chat_template_kwargs``),
over HTTP and gRPC, on the tool tests' stack (started with --trust-request-chat-template): the prompt is what
that template renders, in the same sandbox, and a template that does not compile, escapes the sandbox or
meets a reserved variable is a 400 naming the field."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc

pytestmark = pytest.mark.timeout(300)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Renders the last message as a plain Q/A prompt, with an optional preamble from the request's variables.
QA = "{% if preamble %}{{ preamble }}\n{% endif %}Q: {{ messages[-1].content }}\nA:"


def chat(base_url: str, **body) -> httpx.Response:
    request = {"messages": QUESTION, "max_tokens": 6, "temperature": 0, **body}
    return httpx.post(f"{base_url}/chat/completions", json=request, timeout=300)


def test_the_prompt_is_what_the_requests_template_renders(base_url, client, model):
    out = chat(base_url, chat_template=QA).json()
    # The same text as a plain prompt: the same tokens (the template writes no BOS; nor does this model's tokenizer).
    plain = client.completions.create(
        model=model, prompt="Q: What is the capital of France?\nA:", max_tokens=6, temperature=0
    )
    assert out["usage"]["prompt_tokens"] == plain.usage.prompt_tokens
    assert out["choices"][0]["message"]["content"] == plain.choices[0].text
    own = chat(base_url).json()  # the model's own template: another prompt
    assert own["usage"]["prompt_tokens"] != out["usage"]["prompt_tokens"]


def test_template_kwargs_reach_the_template(base_url):
    preamble = "You answer geography questions in one word."
    bare = chat(base_url, chat_template=QA).json()
    told = chat(base_url, chat_template=QA, chat_template_kwargs={"preamble": preamble}).json()
    assert told["usage"]["prompt_tokens"] > bare["usage"]["prompt_tokens"]


def test_grpc_chat_takes_a_template_too(tools_stack, base_url):
    with grpc.insecure_channel(tools_stack.addr) as channel:
        stub = generate_pb2_grpc.TextGenerationStub(channel)
        request = generate_pb2.ChatRequest(
            messages=[generate_pb2.ChatMessage(**m) for m in QUESTION],
            sampling=common_pb2.SamplingParams(max_tokens=6),
            chat_template=QA,
            chat_template_kwargs=json.dumps({"preamble": "Be brief."}),
        )
        replies = list(stub.Chat(request, timeout=300))
        http = chat(base_url, chat_template=QA, chat_template_kwargs={"preamble": "Be brief."}).json()
        assert replies[-1].usage.prompt_tokens == http["usage"]["prompt_tokens"]
        assert "".join(r.text for r in replies) == http["choices"][0]["message"]["content"]
        bad = generate_pb2.ChatRequest(messages=request.messages, chat_template_kwargs="{")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Chat(bad, timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("chat_template_kwargs: not JSON")


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"chat_template": "{% for %}"}, "chat_template", "does not compile"),
        ({"chat_template": "{{ ''.__class__.__mro__ }}"}, "chat_template", "unsafe"),  # the sandbox holds
        ({"chat_template": "{{ raise_exception('no system turns') }}"}, "chat_template", "no system turns"),
        ({"chat_template": "x" * 65537}, "chat_template", "at most 65536 characters"),
        ({"chat_template": QA, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "set by"),
        ({"chat_template_kwargs": ["not", "a", "mapping"]}, "chat_template_kwargs", ""),
    ],
)
def test_errors_name_the_field(base_url, body, param, message):
    response = chat(base_url, **body)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, error
    assert message in error["message"], error
