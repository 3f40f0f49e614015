"""The OpenAI Agents SDK (``openai-agents``) against a real `kvgrid serve`: an agent with one function tool runs to
a final answer, through the Responses API (``OpenAIResponsesModel``, whole and streamed, and chained by
``previous_response_id``) and through chat completions (``OpenAIChatCompletionsModel``)."""

from __future__ import annotations

import asyncio

import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem
from openai import AsyncOpenAI

pytestmark = pytest.mark.timeout(600)
set_tracing_disabled(True)  # the SDK would send its traces to OpenAI

FORECAST = "Sunny, 21 degrees."


class Weather:
    """The agent's one tool, recording the cities it was asked about."""

    def __init__(self):
        self.cities: list[str] = []

        @function_tool
        def get_weather(city: str) -> str:
            """The weather in a city."""
            self.cities.append(city)
            return FORECAST

        self.tool = get_weather


def agent_with(model, weather: Weather) -> Agent:
    return Agent(
        name="weather",
        instructions="Answer with the get_weather tool, then say what it returned.",
        model=model,
        tools=[weather.tool],
        # The first turn must call the tool (once); the SDK then resets tool_choice to auto, so the answer can
        # follow. The answer has room to end: the SDK takes a response cut at max_output_tokens ("incomplete") as
        # an error.
        model_settings=ModelSettings(temperature=0, tool_choice="required", parallel_tool_calls=False, max_tokens=160),
    )


def check_run(result, weather: Weather) -> None:
    kinds = [type(item) for item in result.new_items]
    assert weather.cities and all(isinstance(c, str) and c for c in weather.cities)
    assert kinds.count(ToolCallItem) == len(weather.cities) == kinds.count(ToolCallOutputItem)
    assert kinds[-1] is MessageOutputItem and isinstance(result.final_output, str) and result.final_output.strip()
    assert len(result.raw_responses) == len(weather.cities) + 1


def run_agent(base_url: str, make_model, stream: bool = False, **run_args):
    weather = Weather()

    async def go():
        async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as client:
            agent = agent_with(make_model(client), weather)
            question = "What is the weather in Paris?"
            if not stream:
                return await Runner.run(agent, question, max_turns=4, **run_args)
            streamed = Runner.run_streamed(agent, question, max_turns=4, **run_args)
            kinds = [event.type async for event in streamed.stream_events()]
            assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
            return streamed

    return asyncio.run(go()), weather


def test_an_agent_on_the_responses_api_runs_to_a_final_answer(base_url):
    result, weather = run_agent(base_url, lambda c: OpenAIResponsesModel("SmolLM2-135M-Instruct", c))
    check_run(result, weather)


def test_an_agent_streamed_on_the_responses_api_runs_to_a_final_answer(base_url):
    result, weather = run_agent(base_url, lambda c: OpenAIResponsesModel("SmolLM2-135M-Instruct", c), stream=True)
    check_run(result, weather)


def test_an_agent_chained_by_previous_response_id_runs_to_a_final_answer(base_url):
    """Each turn sends only its new items; kvgrid's store supplies the conversation before them."""
    model = lambda c: OpenAIResponsesModel("SmolLM2-135M-Instruct", c)  # noqa: E731
    result, weather = run_agent(base_url, model, auto_previous_response_id=True)
    check_run(result, weather)
    assert result.last_response_id and result.last_response_id.startswith("resp_")


def test_an_agent_on_chat_completions_runs_to_a_final_answer(base_url):
    result, weather = run_agent(base_url, lambda c: OpenAIChatCompletionsModel("SmolLM2-135M-Instruct", c))
    check_run(result, weather)
