"""The Responses API (/v1/responses) of a real `kvgrid serve`, through the official `openai` client, sync and async:
whole and streamed answers equal the chat-completions path's, typed events in order, text.format json_schema,
the store (GET, DELETE, previous_response_id) and errors as OpenAI's error object."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from openai import AsyncOpenAI

from tests.e2e.stack import wait_idle

pytestmark = pytest.mark.timeout(300)

QUESTION = "Name two planets of the solar system."
INSTRUCTIONS = "You are a terse astronomer."
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
# A short answer that ends by itself (the stream helpers want ``response.completed``).
PLANET = {
    "type": "json_schema",
    "name": "planet",
    "schema": {
        "type": "object",
        "properties": {"planet": {"enum": ["Mars", "Venus"]}},
        "required": ["planet"],
        "additionalProperties": False,
    },
}
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def chat_answer(client, model, messages, max_tokens):
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


def collapse(types: list[str]) -> list[str]:
    """Runs of the same event type as one."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def test_a_response_is_the_chat_answer_to_the_same_conversation(client, model):
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    chat = chat_answer(client, model, messages, 12)
    out = client.responses.create(
        model=model, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=12, temperature=0
    )
    assert out.object == "response" and out.id.startswith("resp_") and out.model == model
    assert out.output_text == chat.choices[0].message.content and out.output_text
    assert [item.type for item in out.output] == ["message"] and out.output[0].role == "assistant"
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    else:
        assert out.status == "completed" and out.incomplete_details is None
    assert out.instructions == INSTRUCTIONS and out.max_output_tokens == 12 and out.temperature == 0


def test_a_cut_answer_is_incomplete(client, model):
    out = client.responses.create(model=model, input=QUESTION, max_output_tokens=3, temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete"


def test_input_items_are_the_chat_messages(client, model):
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "What is my name?"},
    ]
    chat = chat_answer(client, model, [{"role": "system", "content": INSTRUCTIONS}, *history], 8)
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": INSTRUCTIONS}]},
        {"role": "user", "content": "My name is Ada."},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is my name?"}]},
    ]
    out = client.responses.create(model=model, input=items, max_output_tokens=8, temperature=0)
    assert out.output_text == chat.choices[0].message.content
    assert out.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_has_the_typed_events_in_order_and_the_same_text(client, model):
    whole = client.responses.create(model=model, input=QUESTION, max_output_tokens=10, temperature=0)
    events = list(
        client.responses.create(model=model, input=QUESTION, max_output_tokens=10, temperature=0, stream=True)
    )
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    last = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert collapse(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, last]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text and len(deltas) > 1
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    assert final.id == events[0].response.id and events[0].response.status == "in_progress"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
CALL_EVENTS = [
    "response.output_item.added",
    "response.function_call_arguments.delta",
    "response.function_call_arguments.done",
    "response.output_item.done",
]


def test_function_call_items_whole_and_streamed_then_answered(client, model):
    """A named function: one function_call item whose arguments validate; the stream's argument deltas, in
    order, join to exactly those arguments; the call and its output as input items get a text answer."""
    ask = [{"role": "user", "content": "Add 2 and 3."}]
    request = dict(
        model=model,
        input=ask,
        tools=[ADD],
        tool_choice={"type": "function", "name": "add"},
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    whole = client.responses.create(**request)
    assert whole.status == "completed" and whole.output_text == ""
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])

    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert collapse(types) == ["response.created", "response.in_progress", *CALL_EVENTS, "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == call.arguments
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "add"
    (streamed,) = final.output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {streamed.id}

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    answer = client.responses.create(
        model=model,
        input=[*ask, call.model_dump(exclude_none=True), result],
        tools=[ADD],
        tool_choice="none",
        max_output_tokens=12,
        temperature=0,
    )
    assert answer.output_text and all(item.type == "message" for item in answer.output)
    assert answer.usage.input_tokens > whole.usage.input_tokens


def test_a_chat_message_without_calls_has_no_tool_calls_key(client, model):
    """As OpenAI answers: ``tool_calls`` is absent (not ``[]``) from a message that carries none."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=4, temperature=0
    )
    message = raw.http_response.json()["choices"][0]["message"]
    assert "tool_calls" not in message and message["content"]


def test_text_format_json_schema_gives_valid_json(client, model):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    out = client.responses.create(
        model=model, input="Describe a person as JSON.", text={"format": fmt}, max_output_tokens=60, temperature=0
    )
    jsonschema.validate(json.loads(out.output_text), PERSON)
    assert out.text.format.type == "json_schema" and out.status == "completed"
    with client.responses.stream(
        model=model, input="Describe a person as JSON.", text={"format": fmt}, max_output_tokens=60, temperature=0
    ) as stream:  # the client's helper, assembling the events
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == out.output_text
    assert final.usage.output_tokens == out.usage.output_tokens


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(
        model=model, instructions=INSTRUCTIONS, input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model=model, previous_response_id=first.id, input="What is my name?", max_output_tokens=8, temperature=0
    )
    # The earlier turns, with this request's instructions (none: they are not carried over).
    history = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    chat = chat_answer(client, model, history, 8)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.previous_response_id == first.id
    # A third turn, streamed, continues the second.
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}]
    chat = chat_answer(client, model, history, 8)
    events = client.responses.create(
        model=model, previous_response_id=second.id, input="Thanks.", max_output_tokens=8, temperature=0, stream=True
    )
    third = list(events)[-1].response
    assert third.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(third.id).output_text == third.output_text  # streamed answers are stored too


def test_stored_responses_can_be_read_and_deleted(client, model):
    out = client.responses.create(model=model, input=QUESTION, max_output_tokens=8, temperature=0, metadata={"k": "v"})
    got = client.responses.retrieve(out.id)
    assert got.model_dump() == out.model_dump() and got.store and got.metadata == {"k": "v"}
    deleted = client.responses.delete(out.id)
    assert deleted is None  # the client returns nothing on success
    for call in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError) as err:
            call(out.id)
        assert err.value.body["code"] == "not_found" and out.id in err.value.body["message"]
    unstored = client.responses.create(model=model, input=QUESTION, max_output_tokens=4, temperature=0, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=model, previous_response_id=unstored.id, input="and?", max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"


def test_async_client_creates_and_streams_concurrently(base_url, model, client):
    args = {"model": model, "input": QUESTION, "text": {"format": PLANET}, "max_output_tokens": 16, "temperature": 0}
    whole = client.responses.create(**args)
    assert whole.status == "completed"

    async def run():
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as aclient:

            async def create():
                out = await aclient.responses.create(**args)
                return out.output_text

            async def stream():
                async with aclient.responses.stream(**args) as s:
                    return (await s.get_final_response()).output_text

            return await asyncio.gather(create(), stream(), create(), stream())

    assert asyncio.run(run()) == [whole.output_text] * 4


# (fields, param, status): a bad request and the error it gets.
BAD = {
    "temperature": ({"temperature": -0.5}, "temperature", 400),
    "top_p": ({"top_p": 1.5}, "top_p", 400),
    "input_too_long": ({"input": "hello " * 2000}, "input", 400),
    "item_too_long": (
        {"input": [{"role": "user", "content": "hi"}, {"role": "user", "content": "hello " * 2000}]},
        "input",
        400,
    ),
    "max_output_tokens_past_the_model": ({"max_output_tokens": 5000}, "max_output_tokens", 400),
    "max_output_tokens": ({"max_output_tokens": 0}, "max_output_tokens", 400),
    "background": ({"background": True}, "background", 400),
    "image_part": (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "input[0].content[0]",
        400,
    ),
    "item_type": ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", 400),
    "call_without_id": (
        {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
        "input[0].call_id",
        400,
    ),
    "empty_input": ({"input": []}, "input", 400),
    "role": ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", 400),
    "web_search": ({"tools": [{"type": "web_search"}]}, "tools[0].type", 400),
    "schema": (
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
        "text.format.schema",
        400,
    ),
    "unknown_previous": ({"previous_response_id": "resp_nope"}, "previous_response_id", 404),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_get_openais_error_object(client, model, scheduler_channel, name):
    fields, param, status = BAD[name]
    body = {"model": model, "input": QUESTION, "max_output_tokens": 4, **fields}
    for stream in (False, True):
        with pytest.raises(openai.APIStatusError) as err:
            client.post("/responses", body={**body, "stream": stream}, cast_to=object)
        assert err.value.status_code == status
        error = err.value.body
        assert error["param"] == param, error
        assert "Traceback" not in error["message"]
        if status == 400:
            assert error["type"] == "invalid_request_error" and error["message"].startswith(param + ":"), error
    assert wait_idle(scheduler_channel).num_running == 0


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-4o", input=QUESTION)
    assert err.value.body["code"] == "model_not_found"
