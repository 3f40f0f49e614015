"""``LLM.chat``'s tools: OpenAI's ``tools`` / ``tool_choice`` dicts read into the front door's ``ToolRequest``,
and the calls found in an answer in OpenAI's ``tool_calls`` shape."""

from __future__ import annotations

from collections.abc import Sequence

from services.tokenizer.openai.tools.parser import ToolParser
from services.tokenizer.openai.tools.types import FunctionTool, ToolChoice, ToolRequest, new_call_id


def tool_request(tools: Sequence[dict] | None, tool_choice: str | dict | None, parallel: bool) -> ToolRequest | None:
    """Raises ValueError for a tool or a choice not in OpenAI's shape."""
    if tools is None and tool_choice is None:
        return None
    functions = []
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type", "function") != "function" or not isinstance(function, dict) or "name" not in function:
            raise ValueError(f'tools[{i}]: expected {{"type": "function", "function": {{"name": ..., ...}}}}')
        functions.append(
            FunctionTool(function["name"], function.get("description") or "", function.get("parameters") or {})
        )
    if tool_choice is None:
        choice = ToolChoice("auto" if functions else "none")
    elif tool_choice in ("none", "auto", "required"):
        choice = ToolChoice(tool_choice)
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice = ToolChoice("function", tool_choice["function"].get("name", ""))
    else:
        raise ValueError(
            f'tool_choice: "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}, '
            f"got {tool_choice!r}"
        )
    return ToolRequest(functions, choice, parallel)


def parsed_calls(parser: ToolParser | None, text: str) -> tuple[str, list[dict] | None]:
    """The answer's content and its calls (None when the request had no active tools)."""
    if parser is None:
        return text, None
    parsed = parser.parse(text, final=True)
    calls = [
        {"id": new_call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.calls
    ]
    return parsed.content, calls
