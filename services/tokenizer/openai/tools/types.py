"""Plain records of tool calling, shared by the chat API, the gRPC API, the offline LLM and the Responses API."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

ChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(slots=True)
class FunctionTool:
    """One function the model may call; ``parameters`` is a JSON schema of its arguments (an object)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=dict)

    def as_template_tool(self) -> dict:
        """The OpenAI shape chat templates read (as transformers' ``apply_chat_template(tools=...)`` passes)."""
        function: dict = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters or {"type": "object", "properties": {}}
        return {"type": "function", "function": function}


@dataclass(slots=True)
class ToolChoice:
    """``none``, ``auto``, ``required``, or ``function`` with the one function's ``name``."""

    mode: ChoiceMode = "auto"
    name: str = ""


@dataclass(slots=True)
class ToolRequest:
    """The tools of one request and how the model may use them."""

    tools: list[FunctionTool]
    choice: ToolChoice = field(default_factory=ToolChoice)
    parallel: bool = True  # more than one call in one answer

    @property
    def active(self) -> bool:
        """Whether the output is read for calls (and constrained to them): tools given and a choice other than none."""
        return bool(self.tools) and self.choice.mode != "none"

    def offered(self) -> list[FunctionTool]:
        """The tools the model may call: all of them, or the one named."""
        if self.choice.mode == "function":
            return [t for t in self.tools if t.name == self.choice.name]
        return list(self.tools)


@dataclass(slots=True)
class ToolCall:
    """A call found in the model's text. ``arguments`` is JSON text exactly as the model wrote it (for a
    format whose arguments are not JSON, the JSON the parser built); ``complete`` is False for a call the
    text ends inside of."""

    name: str
    arguments: str
    complete: bool = True


@dataclass(slots=True)
class ParsedOutput:
    """The model's text split into what it said (``content``) and the calls it made, in order."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
