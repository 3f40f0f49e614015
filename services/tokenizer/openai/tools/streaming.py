"""Tool calls as OpenAI stream deltas: the model's text goes in piece by piece; out come content pieces and,
per call, one delta with its ``index``, ``id``, ``type`` and ``function.name``, then ``function.arguments``
pieces.

Each push re-reads the whole text with the parser (``parse(text, final=False)``) and sends what the new reading
adds to what was sent. The parser's promise (``parser.ToolParser``) makes every reading a continuation of the
last, so the pieces of a call's arguments, joined, are exactly the arguments of the final reading, which is
what the same text gives unstreamed, wherever the token boundaries fall.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.tokenizer.openai.tools.parser import ToolParser
from services.tokenizer.openai.tools.types import ParsedOutput, new_call_id


@dataclass(slots=True)
class CallDelta:
    index: int
    arguments: str
    id: str | None = None  # the first delta of a call carries its id and name
    name: str | None = None

    def as_openai(self) -> dict:
        function: dict = {"arguments": self.arguments}
        if self.name is not None:
            function = {"name": self.name, "arguments": self.arguments}
            return {"index": self.index, "id": self.id, "type": "function", "function": function}
        return {"index": self.index, "function": function}


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolCallStream:
    """One choice's text in, its content and call deltas out."""

    def __init__(self, parser: ToolParser):
        self._parser = parser
        self._text = ""
        self._content_sent = 0
        self.call_ids: list[str] = []
        self._arguments_sent: list[int] = []
        self.parsed = ParsedOutput("")

    def push(self, text: str, final: bool = False) -> StreamDelta:
        """The deltas for ``text`` (the next piece of the model's output); ``final`` on the last push."""
        self._text += text
        parsed = self._parser.parse(self._text, final)
        self.parsed = parsed
        out = StreamDelta(parsed.content[self._content_sent :])
        self._content_sent = max(self._content_sent, len(parsed.content))
        for index, call in enumerate(parsed.calls):
            if index == len(self.call_ids):
                self.call_ids.append(new_call_id())
                self._arguments_sent.append(len(call.arguments))
                out.calls.append(CallDelta(index, call.arguments, self.call_ids[index], call.name))
            elif len(call.arguments) > self._arguments_sent[index]:
                out.calls.append(CallDelta(index, call.arguments[self._arguments_sent[index] :]))
                self._arguments_sent[index] = len(call.arguments)
        return out
