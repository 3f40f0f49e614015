"""Tool calling through the official `openai` client against a real `kvgrid serve` (the default model, float32,
greedy): forced calls validate against their schemas, `auto` answers parse, streamed calls equal unstreamed
ones, a full round trip with a tool's result, and the errors a client can cause."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from tests.tools.schemas import TOOLS
from tests.tools.schemas import tool as function_tool

pytestmark = pytest.mark.timeout(900)

ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tools."}]
WEATHER = TOOLS[0]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def nested(levels: int) -> dict:
    """An object schema ``levels`` objects deep (each level two JSON levels: the schema and its properties)."""
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def check_calls(message, names: set[str]) -> None:
    """Every call names one of ``names``, has an id, and its arguments validate against its schema."""
    assert message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def named(client, model: str, tool: dict, **extra):
    name = tool["function"]["name"]
    return client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": f"Call {name} with example values."}],
        tools=[tool, WEATHER] if tool is not WEATHER else [tool],
        tool_choice={"type": "function", "function": {"name": name}},
        temperature=0,
        max_tokens=150,
        parallel_tool_calls=False,
        **extra,
    )


@pytest.mark.parametrize(
    "tools", [pytest.param(TOOLS[:4], id="4-tools"), pytest.param(TOOLS, id="20-tools", marks=pytest.mark.slow)]
)
def test_required_one_call_validates(client, model, tools):
    out = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0.9,
        seed=7,
        max_tokens=150,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1 and choice.message.content is None
    check_calls(choice.message, {t["function"]["name"] for t in tools})


def test_required_parallel_calls_validate(client, model):
    """Parallel calls allowed: the (small, greedy) model may call until max_tokens; every call it finished
    validates, and a call cut short by max_tokens comes last, unfinished, with finish_reason "length"."""
    out = client.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS[:2], tool_choice="required", temperature=0, max_tokens=60
    )
    choice = out.choices[0]
    calls = choice.message.tool_calls
    assert calls and choice.finish_reason in ("tool_calls", "length")
    finished = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    for call in finished:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


SOME = [TOOLS[i] for i in (0, 4, 7, 11)]


@pytest.mark.parametrize(
    "tools", [pytest.param(SOME, id="4-schemas"), pytest.param(TOOLS, id="20-schemas", marks=pytest.mark.slow)]
)
def test_named_calls_validate_sync_and_async(client, base_url, model, tools):
    """Each function named in turn: the sync client for half of them, the async client (concurrently) for the rest."""
    half = len(tools) // 2
    for tool in tools[:half]:
        out = named(client, model, tool)
        check_calls(out.choices[0].message, {tool["function"]["name"]})

    async def run():
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600) as aclient:
            return await asyncio.gather(*(named(aclient, model, tool) for tool in tools[half:]))

    for tool, out in zip(tools[half:], asyncio.run(run()), strict=True):
        check_calls(out.choices[0].message, {tool["function"]["name"]})


def test_auto_answers_text_or_calls_that_parse(client, model):
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        out = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS[:4], temperature=0, max_tokens=120
        )
        message = out.choices[0].message
        if message.tool_calls:
            check_calls(message, {t["function"]["name"] for t in TOOLS[:4]})
            assert out.choices[0].finish_reason == "tool_calls"
        else:
            assert message.content and "<tool_call>" not in message.content
            assert out.choices[0].finish_reason in ("stop", "length")


def streamed_message(client, **request) -> tuple[str, list[dict], str]:
    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                if call.id is not None:
                    assert call.index == len(calls) and call.function.name
                    calls.append({"name": call.function.name, "arguments": call.function.arguments or ""})
                else:
                    assert call.function.name is None
                    calls[call.index]["arguments"] += call.function.arguments
            finish = choice.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("tool_choice", ["required", "auto", {"type": "function", "function": {"name": "book_flight"}}])
def test_streamed_calls_equal_unstreamed(client, model, tool_choice):
    request = dict(model=model, messages=ASK, tools=TOOLS[:5], tool_choice=tool_choice, temperature=0, max_tokens=80)
    whole = client.chat.completions.create(**request).choices[0]
    content, calls, finish = streamed_message(client, **request)
    expected = [{"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls or []]
    assert calls == expected
    assert content == (whole.message.content or "")
    assert finish == whole.finish_reason
    if tool_choice != "auto":
        assert calls


def test_round_trip_with_a_tool_result(client, model):
    first = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = client.chat.completions.create(
        model=model, messages=history, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=20
    )
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")
    # The history reached the model: the tool's result is in the prompt.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
        ({"tools": [], "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name", "letters"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "structured output",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", ""),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        # Schemas the grammar engine cannot take: a clear 400 before any work, never a hang or a 500.
        ({"tools": [function_tool("deep", "", {"x": nested(60)})]}, "tools[0].function.parameters", "levels deep"),
        (
            {"tools": [function_tool("big", "", {"x": {"enum": [f"v{i}" for i in range(20000)]}})]},
            "tools",
            "characters",
        ),
        ({"tools": [function_tool("bad", "", {"x": {"type": "string", "pattern": "(("}})]}, "tools", "unclosed group"),
        (  # a costly pattern on an argument the grammar's first tokens do not reach
            {"tools": [function_tool("slow", "", {"a": {"type": "integer"}, "b": {"pattern": "^(a{1000}){1000}$"}})]},
            "tools[0].function.parameters",
            "too costly",
        ),
    ],
)
def test_errors_name_the_field(client, model, extra, param, message):
    request = {"model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 5, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**request)
    body = err.value.body
    assert err.value.status_code == 400
    assert param in (body.get("param") or ""), body
    assert message in body["message"], body
