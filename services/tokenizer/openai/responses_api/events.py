"""The chat stream's chunks as the Responses API's typed events, in OpenAI's order.

``response.created`` and ``response.in_progress`` first; then per output item ``response.output_item.added``,
its content (``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done`` for text; ``response.function_call_arguments.delta``...,
``response.function_call_arguments.done`` for a call) and ``response.output_item.done``; last
``response.completed`` (or ``response.incomplete``) with the whole response. Every event carries its
``sequence_number``, from 0. An item is closed when the chunks move on to another one (text to a call, one call
to the next) or at the end, so items never interleave.
"""

from __future__ import annotations

import json

from services.common.errors import KvgridError
from services.tokenizer.openai.errors import error_body
from services.tokenizer.openai.responses_api import objects as o
from services.tokenizer.openai.responses_api.output import finish, response_usage


class EventWriter:
    """Turns one response's chat chunks (as dicts) into SSE events; ``items`` are its output so far."""

    def __init__(self, response: o.Response):
        self.response = response
        self.items: list[o.OutputItem] = []
        self.sequence_number = 0
        self.open: o.OutputItem | None = None
        self.open_call_index: int | None = None  # the chat tool call index of the open function_call item
        self.finish_reason: str | None = None

    def start(self) -> list[str]:
        body = self.response.model_dump()
        return [self._event("response.created", response=body), self._event("response.in_progress", response=body)]

    def chunk(self, chunk: dict) -> list[str]:
        """The events for one chat chunk (no events for a chunk with nothing new)."""
        events: list[str] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("content"):
                events += self._text(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return events

    def end(self, usage: dict | None) -> tuple[list[str], o.Response]:
        """The closing events and the finished response."""
        events = self._close()
        response = finish(self.response, self.items, self.finish_reason, usage)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        return events + [self._event(kind, response=response.model_dump())], response

    def fail(self, exc: KvgridError) -> list[str]:
        """An error after the stream began: an ``error`` event (OpenAI's error fields), then ``response.failed``."""
        info = error_body(exc, getattr(exc, "public_field", None) or getattr(exc, "field", None))[1].error
        self.response.status = "failed"
        self.response.output = self.items
        self.response.error = o.ResponseError(code=info.code or "server_error", message=info.message)
        self.response.usage = response_usage({})
        return [
            self._event("error", code=info.code, message=info.message, param=info.param),
            self._event("response.failed", response=self.response.model_dump()),
        ]

    # --- items ---

    def _text(self, text: str) -> list[str]:
        events: list[str] = []
        if not isinstance(self.open, o.OutputMessage):
            events += self._close()
            item = o.OutputMessage(id=o.new_id("msg"), status="in_progress", content=[])
            events += self._add(item)
            part = o.OutputText()
            item.content.append(part)
            events.append(self._event("response.content_part.added", **self._at(item), part=part.model_dump()))
        item = self.open
        item.content[0].text += text
        events.append(self._event("response.output_text.delta", **self._at(item), delta=text, logprobs=[]))
        return events

    def _call(self, call: dict) -> list[str]:
        events: list[str] = []
        function = call.get("function") or {}
        index = call.get("index", 0)
        if not isinstance(self.open, o.FunctionCall) or index != self.open_call_index:
            events += self._close()
            item = o.FunctionCall(
                id=o.new_id("fc"),
                call_id=call.get("id") or o.new_id("call"),
                name=function.get("name") or "",
                arguments="",
                status="in_progress",
            )
            self.open_call_index = index
            events += self._add(item)
        item = self.open
        if function.get("arguments"):
            item.arguments += function["arguments"]
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=len(self.items) - 1,
                    delta=function["arguments"],
                )
            )
        return events

    def _add(self, item: o.OutputItem) -> list[str]:
        self.items.append(item)
        self.open = item
        return [self._event("response.output_item.added", output_index=len(self.items) - 1, item=item.model_dump())]

    def _close(self) -> list[str]:
        item, self.open, self.open_call_index = self.open, None, None
        if item is None:
            return []
        cut = self.finish_reason == "length" and isinstance(item, o.OutputMessage)
        item.status = "incomplete" if cut else "completed"
        output_index = self.items.index(item)
        if isinstance(item, o.OutputMessage):
            part = item.content[0]
            at = self._at(item)
            events = [
                self._event("response.output_text.done", **at, text=part.text, logprobs=[]),
                self._event("response.content_part.done", **at, part=part.model_dump()),
            ]
        else:
            events = [
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=output_index,
                    name=item.name,
                    arguments=item.arguments,
                )
            ]
        return events + [self._event("response.output_item.done", output_index=output_index, item=item.model_dump())]

    def _at(self, item: o.OutputMessage) -> dict:
        return {"item_id": item.id, "output_index": self.items.index(item), "content_index": 0}

    def _event(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body)}\n\n"
