"""LangChain's OpenAI chat model against a real `kvgrid serve`: `bind_tools` yields tool calls whose arguments
validate, and `with_structured_output` returns the schema's object both as a forced call (function_calling: a
pydantic schema, which leaves additionalProperties unsaid) and as a response format (json_schema)."""

from __future__ import annotations

import jsonschema
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.tools.schemas import TOOLS

pytestmark = pytest.mark.timeout(600)


def chat_model(base_url: str, model: str, **extra) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=base_url, api_key="unused", model=model, temperature=0, max_retries=0, timeout=300, **extra
    )


def test_bind_tools_yields_tool_calls(base_url, model):
    tools = TOOLS[:3]
    llm = chat_model(base_url, model, max_tokens=80).bind_tools(tools, tool_choice="required")
    message = llm.invoke("What is the weather in Paris?")
    assert message.tool_calls and not message.invalid_tool_calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for call in message.tool_calls:
        assert call["id"].startswith("call_") and call["name"] in params
        jsonschema.validate(call["args"], params[call["name"]])
    assert message.response_metadata["finish_reason"] == "tool_calls"


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=12)
    country: str = Field(max_length=12)
    population: int = Field(ge=0, le=10**8)


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_with_structured_output(base_url, model, method):
    llm = chat_model(base_url, model, max_tokens=80).with_structured_output(City, method=method, include_raw=True)
    out = llm.invoke("Name a large city.")
    assert out["parsing_error"] is None, out
    assert isinstance(out["parsed"], City), out
