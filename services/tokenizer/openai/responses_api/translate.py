"""A Responses request as the chat-completions body the front door prepares, and the chat path's field names back
as the Responses request's own.

``input`` (a string, or message / function_call / function_call_output items) after the stored conversation of
``previous_response_id`` becomes ``messages``, with ``instructions`` as the first, system, message; an assistant
message and the function calls after it become one assistant message with ``tool_calls``; a call's output becomes
a ``tool`` message. ``tools``, ``tool_choice``, ``text.format``, ``max_output_tokens``, ``temperature`` and
``top_p`` become their chat fields. Items are kept in one plain form (``canonical_items``), the form the store
holds a conversation in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import ValidationError

from services.common.errors import InvalidArgument
from services.tokenizer.openai.errors import invalid_body
from services.tokenizer.openai.protocol import ChatCompletionRequest
from services.tokenizer.openai.responses_api.protocol import ContentPart, InputItem, ResponsesRequest

MESSAGE_ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
HISTORY = "previous_response_id"  # what a message from the stored conversation is called in an error
_MESSAGE = re.compile(r"messages\[(\d+)\](.*)")
_TOOL = re.compile(r"tools\[(\d+)\]\.function(.*)")
_RENAMED = (  # chat's field -> the Responses request's, longest first
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ("tool_choice.function.name", "tool_choice.name"),
    ("tool_choice.function", "tool_choice"),
)


@dataclass(slots=True)
class ChatTranslation:
    """The chat body, and where each of its messages came from (``origins[k]`` names message k's source)."""

    chat: ChatCompletionRequest
    origins: list[str]

    def public_field(self, field: str) -> str:
        return public_field(field, self.origins)


def public_field(field: str, origins: list[str]) -> str:
    """A chat-path field name (``messages[2].content``, ``max_completion_tokens``) in the Responses request's own
    names; ``origins[k]`` is where chat message k came from."""
    match = _MESSAGE.fullmatch(field)
    if match is not None:
        k = int(match[1])
        origin = origins[k] if k < len(origins) else "input"
        return origin + match[2] if origin.startswith("input[") else origin
    if field == "messages":
        return "input"
    match = _TOOL.fullmatch(field)
    if match is not None:
        return f"tools[{match[1]}]{match[2]}"
    for chat_name, name in _RENAMED:
        if field == chat_name or field.startswith(chat_name + "."):
            return name + field[len(chat_name) :]
    return field


def canonical_items(given: str | list[InputItem]) -> list[dict]:
    """The request's ``input`` as plain items; raises ``InvalidArgument`` naming ``input[i].<field>``."""
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if not given:
        raise InvalidArgument("input", "empty: give text or at least one item")
    return [_canonical(f"input[{i}]", item) for i, item in enumerate(given)]


def _canonical(at: str, item: InputItem) -> dict:
    if item.type == "message":
        if item.role not in MESSAGE_ROLES:
            raise InvalidArgument(f"{at}.role", f"must be one of {', '.join(MESSAGE_ROLES)}, got {item.role!r}")
        return {"type": "message", "role": item.role, "content": _text(f"{at}.content", item.content)}
    if item.type == "function_call":
        for name in ("call_id", "name", "arguments"):
            if getattr(item, name) is None:
                raise InvalidArgument(f"{at}.{name}", "required in a function_call item")
        return {"type": "function_call", "call_id": item.call_id, "name": item.name, "arguments": item.arguments}
    if item.type == "function_call_output":
        if item.call_id is None:
            raise InvalidArgument(f"{at}.call_id", "required in a function_call_output item")
        return {"type": "function_call_output", "call_id": item.call_id, "output": _text(f"{at}.output", item.output)}
    raise InvalidArgument(
        f"{at}.type", f"not supported by kvgrid: {item.type!r} (messages, function_call, function_call_output)"
    )


def _text(at: str, content: str | list[ContentPart] | None) -> str:
    if content is None:
        raise InvalidArgument(at, "required")
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise InvalidArgument(f"{at}[{j}]", f"only text parts are supported, got type {part.type!r}")
    return "".join(part.text for part in content)


def chat_translation(req: ResponsesRequest, history: list[dict], items: list[dict], request_id: str) -> ChatTranslation:
    """The chat body for ``req`` whose conversation so far is ``history`` and whose own input is ``items``."""
    messages: list[dict] = []
    origins: list[str] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    for origin, item in [(HISTORY, item) for item in history] + _input_origins(req, items):
        _append_message(messages, origins, origin, item)
    body: dict = {"messages": messages, "n": 1, "stream": req.stream, "request_id": request_id}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [_chat_tool(f"tools[{i}]", t.model_dump(exclude_none=True)) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
        spec = {k: v for k, v in spec.items() if v is not None}
        body["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    try:
        return ChatTranslation(ChatCompletionRequest.model_validate(body), origins)
    except ValidationError as exc:
        error, param = invalid_body(exc.errors())
        error.public_field = public_field(param or error.field, origins)
        raise error from None


def _input_origins(req: ResponsesRequest, items: list[dict]) -> list[tuple[str, dict]]:
    if isinstance(req.input, str):
        return [("input", items[0])]
    return [(f"input[{i}]", item) for i, item in enumerate(items)]


def _append_message(messages: list[dict], origins: list[str], origin: str, item: dict) -> None:
    kind = item["type"]
    if kind == "message":
        messages.append({"role": item["role"], "content": item["content"]})
        origins.append(origin)
    elif kind == "function_call":
        function = {"name": item["name"], "arguments": item["arguments"]}
        call = {"id": item["call_id"], "type": "function", "function": function}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            origins.append(origin)
    else:  # function_call_output
        messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        origins.append(origin)


def _chat_tool(at: str, tool: dict) -> dict:
    if tool.get("type") != "function":
        raise InvalidArgument(f"{at}.type", f"only function tools are supported, got {tool.get('type')!r}")
    if not tool.get("name"):
        raise InvalidArgument(f"{at}.name", "required")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice) -> str | dict:
    if isinstance(choice, str):
        return choice
    if choice.type != "function":
        raise InvalidArgument("tool_choice.type", f"only a function may be named, got {choice.type!r}")
    if not choice.name:
        raise InvalidArgument("tool_choice.name", "required")
    return {"type": "function", "function": {"name": choice.name}}
