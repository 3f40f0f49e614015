"""The chat path's answer as a Response: the assistant's text as a message item, each tool call as a function_call
item, the chat usage as Responses usage; and the conversation a stored response continues from."""

from __future__ import annotations

import time

from services.tokenizer.openai.responses_api import objects as o
from services.tokenizer.openai.responses_api.protocol import ResponsesRequest


def base_response(req: ResponsesRequest, response_id: str, model: str, stored: bool) -> o.Response:
    """The Response with everything the request decides, status ``in_progress`` and no output yet."""
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return o.Response(
        id=response_id,
        created_at=int(time.time()),
        status="in_progress",
        model=model,
        instructions=req.instructions,
        previous_response_id=req.previous_response_id,
        store=stored,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=True if req.parallel_tool_calls is None else req.parallel_tool_calls,
        tool_choice=_tool_choice(req),
        tools=[tool.model_dump(exclude_none=True) for tool in req.tools or []],
        text={"format": fmt or {"type": "text"}},
        metadata=req.metadata or {},
        user=req.user,
    )


def finish(
    response: o.Response, items: list[o.OutputItem], finish_reason: str | None, usage: dict | None
) -> o.Response:
    """``response`` completed with ``items``; ``incomplete`` when the output reached its length limit (then so is
    its last item, when that is text)."""
    incomplete = finish_reason == "length"
    for item in items:
        item.status = "completed"
    if incomplete and items and isinstance(items[-1], o.OutputMessage):
        items[-1].status = "incomplete"
    response.output = items
    response.status = "incomplete" if incomplete else "completed"
    response.incomplete_details = o.IncompleteDetails(reason="max_output_tokens") if incomplete else None
    response.completed_at = int(time.time())
    response.usage = response_usage(usage or {})
    return response


def output_items(message: dict) -> list[o.OutputItem]:
    """A chat assistant message (``content``, ``tool_calls``) as output items."""
    items: list[o.OutputItem] = []
    if message.get("content"):
        text = o.OutputText(text=message["content"])
        items.append(o.OutputMessage(id=o.new_id("msg"), status="completed", content=[text]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        items.append(
            o.FunctionCall(
                id=o.new_id("fc"),
                call_id=call["id"],
                name=function["name"],
                arguments=function["arguments"],
                status="completed",
            )
        )
    return items


def response_usage(usage: dict) -> o.ResponseUsage:
    """Chat usage (``prompt_tokens``, ``completion_tokens``) as Responses usage."""
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return o.ResponseUsage(
        input_tokens=usage.get("prompt_tokens", 0),
        input_tokens_details=o.InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.get("completion_tokens", 0),
        total_tokens=usage.get("total_tokens", 0),
    )


def conversation_items(items: list[o.OutputItem]) -> list[dict]:
    """Output items as the plain input items a next turn continues from (see ``translate.canonical_items``)."""
    out = []
    for item in items:
        if isinstance(item, o.OutputMessage):
            out.append({"type": "message", "role": "assistant", "content": "".join(p.text for p in item.content)})
        else:
            call = {"call_id": item.call_id, "name": item.name, "arguments": item.arguments}
            out.append({"type": "function_call", **call})
    return out


def _tool_choice(req: ResponsesRequest):
    if req.tool_choice is None:
        return "auto" if req.tools else "none"
    if isinstance(req.tool_choice, str):
        return req.tool_choice
    return req.tool_choice.model_dump(exclude_none=True)
