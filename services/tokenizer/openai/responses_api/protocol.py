"""The body of ``POST /v1/responses``, as pydantic models.

Types only, as for the other routes; what an item must hold for its ``type`` is ``translate``'s check, so that a
bad item is named ``input[2].call_id`` rather than by pydantic's union members. Unknown fields are ignored; a
field kvgrid knows and does not support is refused by name unless it carries the value that means "off".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from services.tokenizer.openai.protocol import CheckedModel, refuse_unsupported

RESPONSES_UNSUPPORTED: dict[str, tuple[tuple, str]] = {
    "background": ((None, False), "background responses"),
    "conversation": ((None,), "conversations; use previous_response_id"),
    "prompt": ((None,), "prompt templates"),
    "reasoning": ((None, {}), "reasoning settings"),
    "truncation": ((None, "disabled"), "truncation of the input"),
    "include": ((None, []), "extra output (include)"),
    "top_logprobs": ((None, 0), "logprobs"),
    "max_tool_calls": ((None,), "a bound on tool calls"),
    "context_management": ((None,), "context management"),
}


class ContentPart(CheckedModel):
    """A part of a message's content; only text parts are supported (``translate`` refuses the others)."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class InputItem(CheckedModel):
    """One ``input`` item: a message (``type`` "message", or none), a ``function_call`` or a
    ``function_call_output``. Which fields it needs depends on its type."""

    model_config = ConfigDict(extra="allow")

    type: str = "message"
    id: str | None = None
    status: str | None = None
    # message
    role: str | None = None
    content: str | list[ContentPart] | None = None
    # function_call
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    # function_call_output
    output: str | list[ContentPart] | None = None


class FunctionTool(CheckedModel):
    model_config = ConfigDict(extra="allow")

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(CheckedModel):
    type: str
    name: str | None = None


class TextFormat(CheckedModel):
    """``text.format``: plain text, any JSON object, or JSON that follows ``schema``."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(CheckedModel):
    format: TextFormat | None = None


class ResponsesRequest(CheckedModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Field(ge=1, lt=2**32)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, body: Any) -> Any:
        return refuse_unsupported(body, RESPONSES_UNSUPPORTED)
