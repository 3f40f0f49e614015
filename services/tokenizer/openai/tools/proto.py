"""The gRPC Chat API's tools: a ``ChatRequest``'s messages, tools and template fields read into the front
door's records, and the output's calls written into ``GenerateResponse.tool_calls`` as OpenAI-shaped deltas."""

from __future__ import annotations

import json

from kvgrid.v1 import generate_pb2
from services.common.errors import InvalidArgument
from services.tokenizer.frontdoor import ChatPrompt
from services.tokenizer.openai.tools.parser import ToolParser
from services.tokenizer.openai.tools.streaming import ToolCallStream
from services.tokenizer.openai.tools.support import template_tool_calls
from services.tokenizer.openai.tools.types import ChoiceMode, FunctionTool, ToolChoice, ToolRequest

MODES: tuple[ChoiceMode, ...] = ("none", "auto", "required", "function")


def messages_from_proto(messages) -> list[dict]:
    """``ChatMessage``s as the front door's dicts: role and content, an assistant's ``tool_calls``, a tool
    message's ``tool_call_id`` and ``name`` (each only when set). A message with images has parts: its images
    first, then its text."""
    out = []
    for i, m in enumerate(messages):
        message: dict = {"role": m.role, "content": m.content}
        if m.images:
            images = [
                {"type": "image", "image": data, "field": f"messages[{i}].images[{j}]"}
                for j, data in enumerate(m.images)
            ]
            message["content"] = [*images, {"type": "text", "text": m.content}]
        if m.tool_calls:
            calls = [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]
            message["tool_calls"] = template_tool_calls(calls)
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        if m.name:
            message["name"] = m.name
        out.append(message)
    return out


def chat_prompt_from_proto(request: generate_pb2.ChatRequest) -> ChatPrompt:
    """The conversation, its tools and its own template fields. Raises ``InvalidArgument`` naming the field."""
    kwargs = None
    if request.chat_template_kwargs:
        try:
            kwargs = json.loads(request.chat_template_kwargs)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise InvalidArgument("chat_template_kwargs", f"not JSON: {exc}") from None
    template = request.chat_template if request.HasField("chat_template") else None
    return ChatPrompt(
        messages_from_proto(request.messages),
        tools=tool_request_from_proto(request),
        chat_template=template,
        chat_template_kwargs=kwargs,
    )


def tool_request_from_proto(request: generate_pb2.ChatRequest) -> ToolRequest | None:
    """The request's tools and tool_choice (unset: ``auto`` with tools, ``none`` without); None when it has
    neither. Raises ``InvalidArgument`` naming the field for a parameters text that is not JSON, a tool type
    other than function, or an unknown mode."""
    if not request.tools and not request.HasField("tool_choice"):
        return None
    tools = []
    for i, tool in enumerate(request.tools):
        if tool.type not in ("", "function"):
            raise InvalidArgument(f"tools[{i}].type", f"only 'function' tools exist, got {tool.type!r}")
        parameters: object = {}
        if tool.function.parameters:
            try:
                parameters = json.loads(tool.function.parameters)
            except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested beyond any schema
                raise InvalidArgument(f"tools[{i}].function.parameters", f"not JSON: {exc}") from None
        tools.append(FunctionTool(tool.function.name, tool.function.description, parameters))  # type: ignore[arg-type]
    mode = request.tool_choice.mode or ("auto" if tools else "none")
    if mode not in MODES:
        raise InvalidArgument("tool_choice.mode", f"one of {', '.join(MODES)}, got {mode!r}")
    if mode == "function" and not request.tool_choice.function_name:
        raise InvalidArgument("tool_choice.function_name", "mode 'function' names the function to call")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolRequest(tools, ToolChoice(mode, request.tool_choice.function_name), parallel)


class ToolCallDeltas:
    """One Chat stream's output read for calls: each response's ``text`` becomes the content the parser lets
    through, and the calls' pieces go into ``tool_calls``; an answer that stopped after calls ends with
    finish_reason ``tool_calls``."""

    def __init__(self, parser: ToolParser):
        self._stream = ToolCallStream(parser)

    def apply(self, out: generate_pb2.GenerateResponse) -> generate_pb2.GenerateResponse:
        pushed = self._stream.push(out.text, final=bool(out.finish_reason))
        out.text = pushed.content
        for call in pushed.calls:
            delta = out.tool_calls.add(index=call.index)
            delta.function.arguments = call.arguments
            if call.name is not None:
                delta.id, delta.type, delta.function.name = call.id, "function", call.name
        if out.finish_reason == "stop" and self._stream.call_ids:
            out.finish_reason = "tool_calls"
        return out
