"""Tools over the gRPC Chat API of the same `kvgrid serve` the OpenAI tool tests use: a named call streams as
OpenAI-shaped deltas that reassemble to exactly the OpenAI route's (greedy) call, a history with calls and a
tool's result renders, and a client's mistakes are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import json

import grpc
import jsonschema
import pytest

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from tests.tools.schemas import TOOLS, tool

pytestmark = pytest.mark.timeout(600)

ADD = TOOLS[1]
ASK = [{"role": "user", "content": "Add 2 and 3. Use the tools."}]


@pytest.fixture(scope="module")
def stub(tools_stack):
    with grpc.insecure_channel(tools_stack.addr) as channel:
        yield generate_pb2_grpc.TextGenerationStub(channel)


def proto_tool(tool: dict) -> generate_pb2.Tool:
    f = tool["function"]
    definition = generate_pb2.FunctionDefinition(
        name=f["name"], description=f["description"], parameters=json.dumps(f["parameters"])
    )
    return generate_pb2.Tool(type="function", function=definition)


def chat(stub, messages: list[generate_pb2.ChatMessage], **fields) -> list[generate_pb2.GenerateResponse]:
    sampling = common_pb2.SamplingParams(temperature=0, max_tokens=60)
    return list(stub.Chat(generate_pb2.ChatRequest(messages=messages, sampling=sampling, **fields), timeout=300))


def reassembled(replies: list[generate_pb2.GenerateResponse]) -> tuple[str, list[dict], str]:
    text, calls = "", []
    for reply in replies:
        text += reply.text
        for delta in reply.tool_calls:
            if delta.id:
                assert delta.index == len(calls) and delta.type == "function" and delta.function.name
                assert delta.id.startswith("call_")
                calls.append({"id": delta.id, "name": delta.function.name, "arguments": delta.function.arguments})
            else:
                assert not delta.function.name and not delta.type
                calls[delta.index]["arguments"] += delta.function.arguments
    return text, calls, replies[-1].finish_reason


def test_named_call_streams_as_the_openai_route_answers(stub, client, model):
    ask = [generate_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in ASK]
    choice = generate_pb2.ToolChoice(mode="function", function_name="add")
    tools = [proto_tool(ADD), proto_tool(TOOLS[0])]
    replies = chat(stub, ask, tools=tools, tool_choice=choice)
    text, calls, finish = reassembled(replies)
    assert finish == "tool_calls" and text == ""
    assert [c["name"] for c in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD["function"]["parameters"])
    assert replies[-1].usage.completion_tokens > 0
    whole = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[ADD, TOOLS[0]],
        tool_choice={"type": "function", "function": {"name": "add"}},
        temperature=0,
        max_tokens=60,
    )
    assert [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls] == [
        (c["name"], c["arguments"]) for c in calls
    ]

    # The call and its result as history: rendered (the result reaches the prompt), answered in text.
    call = generate_pb2.ToolCall(
        id=calls[0]["id"],
        type="function",
        function=generate_pb2.FunctionCall(name="add", arguments=calls[0]["arguments"]),
    )
    history = [
        *ask,
        generate_pb2.ChatMessage(role="assistant", tool_calls=[call]),
        generate_pb2.ChatMessage(role="tool", content='{"sum": 5}', tool_call_id=call.id, name="add"),
    ]
    answer = chat(stub, history, tools=tools, tool_choice=generate_pb2.ToolChoice(mode="none"))
    text, calls, finish = reassembled(answer)
    assert text and not calls and finish in ("stop", "length")
    assert answer[-1].usage.prompt_tokens > replies[-1].usage.prompt_tokens


def test_without_tools_text_is_untouched(stub):
    """No tools: the output is not read for calls (hermes markup, if any, would stay in text)."""
    replies = chat(stub, [generate_pb2.ChatMessage(role="user", content="Say hi.")])
    assert not any(r.tool_calls for r in replies) and replies[-1].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        (
            {"tools": [generate_pb2.Tool(function=generate_pb2.FunctionDefinition(name="f", parameters="{"))]},
            "tools[0].function.parameters",
            "not JSON",
        ),
        (
            {"tools": [generate_pb2.Tool(type="code", function=generate_pb2.FunctionDefinition(name="f"))]},
            "tools[0].type",
            "only 'function'",
        ),
        ({"tool_choice": generate_pb2.ToolChoice(mode="sometimes")}, "tool_choice.mode", "one of none"),
        ({"tool_choice": generate_pb2.ToolChoice(mode="function")}, "tool_choice.function_name", "names the"),
        (
            {"tool_choice": generate_pb2.ToolChoice(mode="function", function_name="nope")},
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": generate_pb2.ToolChoice(mode="required"), "tools": []}, "tool_choice", "needs tools"),
        (
            {"tools": [proto_tool(tool("big", "", {"x": {"enum": [f"v{i}" for i in range(20000)]}}))]},
            "tools",
            "characters",
        ),
        ({"tools": [proto_tool(tool("bad", "", {"x": {"pattern": "(("}}))]}, "tools", "unclosed group"),
        (
            {"tools": [generate_pb2.Tool(function=generate_pb2.FunctionDefinition(name="f", parameters="[" * 5000))]},
            "tools[0].function.parameters",
            "not JSON",
        ),
        (
            {"tools": [proto_tool(tool("deep", "", {"x": json.loads('{"a": ' * 120 + "1" + "}" * 120)}))]},
            "tools[0].function.parameters",
            "levels deep",
        ),
    ],
)
def test_errors_name_the_field(stub, fields, field, message):
    fields = {"tools": [proto_tool(ADD)], **fields}
    with pytest.raises(grpc.RpcError) as err:
        chat(stub, [generate_pb2.ChatMessage(role="user", content="hi")], **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details() and message in err.value.details(), err.value.details()
