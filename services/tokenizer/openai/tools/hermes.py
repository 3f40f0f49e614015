"""Hermes-style calls (Qwen2.5, Hermes 2/3, SmolLM with the shipped template): free text, then calls as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one per tag."""

from __future__ import annotations

from services.tokenizer.openai.tools.json_scan import Malformed, skip_ws
from services.tokenizer.openai.tools.parser import ToolParser, json_call, visible_text
from services.tokenizer.openai.tools.types import FunctionTool, ParsedOutput, ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# Free text: anything that does not contain the opening tag (llguidance's lexemes take ``&`` and ``~``).
NO_TAG = r"/(.|\n)*/ & ~/(.|\n)*<tool_call>(.|\n)*/"


class HermesParser(ToolParser):
    name = "hermes"
    template = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        start = text.find(OPEN)
        if start < 0:
            return ParsedOutput(visible_text(text, final, OPEN))
        calls: list[ToolCall] = []
        i = start
        while i >= 0:
            j = skip_ws(text, i + len(OPEN))
            try:
                call, end = json_call(text, j, final) if j < len(text) else (None, None)
            except Malformed:
                call, end = None, None
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            close = text.find(CLOSE, end)
            i = -1 if close < 0 else text.find(OPEN, close)
        before = text[:start]
        if not calls:  # a tag not followed by a call (yet): text, once the text is over
            return ParsedOutput(text if final else visible_text(before, final))
        return ParsedOutput(before.rstrip(), calls)

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        more = ' ("\\n" call)*' if parallel else ""
        rules = [
            'call: "<tool_call>\\n" body "\\n</tool_call>"',
            self.body_rules(tools),
        ]
        if required:
            return "\n".join([f"start: call{more}", *rules])
        # Text, or text that ends in the first call's opening tag (one lexeme: the lexer need not guess where
        # the text ends), then the calls.
        return "\n".join(
            [
                f'start: TEXT | OPEN body "\\n</tool_call>"{more}',
                f"TEXT: {NO_TAG}",
                f'OPEN: {NO_TAG} "<tool_call>\\n"',
                *rules,
            ]
        )
