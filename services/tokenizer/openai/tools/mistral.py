"""Mistral calls: free text, then ``[TOOL_CALLS]`` and a JSON array of ``{"name": ..., "arguments": {...}}``.
``[TOOL_CALLS]`` is a special token of Mistral's tokenizers, which the detokenizer leaves out of the text, so
an answer that begins with ``[{`` is read as the array too."""

from __future__ import annotations

from services.tokenizer.openai.tools.json_scan import skip_ws
from services.tokenizer.openai.tools.parser import ToolParser, json_calls, visible_text
from services.tokenizer.openai.tools.types import FunctionTool, ParsedOutput

TAG = "[TOOL_CALLS]"
NO_TAG = r"/(.|\n)*/ & ~/(.|\n)*\[TOOL_CALLS\](.|\n)*/"


class MistralParser(ToolParser):
    name = "mistral"
    template = "mistral"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        tag = text.find(TAG)
        if tag >= 0:
            before, i = text[:tag], skip_ws(text, tag + len(TAG))
        else:
            i = skip_ws(text, 0)
            j = skip_ws(text, i + 1)
            if i < len(text) and text[i] == "[" and (j == len(text) and not final or text[j : j + 1] == "{"):
                before = ""  # a bare array of calls, or the start of one
            else:
                return ParsedOutput(visible_text(text, final, TAG))
        if i >= len(text) or text[i] != "[":
            return ParsedOutput(text if final else visible_text(before, final))
        calls = json_calls(text, skip_ws(text, i + 1), final, ",")
        if not calls:
            return ParsedOutput(text if final else visible_text(before, final))
        return ParsedOutput(before.rstrip(), calls)

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        more = ' (", " body)*' if parallel else ""
        calls = f'"[" body{more} "]"'
        if required:
            return "\n".join([f'start: "[TOOL_CALLS]" {calls}', self.body_rules(tools)])
        return "\n".join(
            [
                f"start: TEXT | OPEN {calls}",
                f"TEXT: {NO_TAG}",
                f'OPEN: {NO_TAG} "[TOOL_CALLS]"',
                self.body_rules(tools),
            ]
        )
