"""Llama 3.1/3.2 JSON calls: the answer is either text or calls, each ``{"name": ..., "parameters": {...}}``,
separated by ``; ``, optionally after ``<|python_tag|>``."""

from __future__ import annotations

from services.tokenizer.openai.tools.json_scan import skip_ws
from services.tokenizer.openai.tools.parser import ToolParser, json_calls, visible_text
from services.tokenizer.openai.tools.types import FunctionTool, ParsedOutput

PYTHON_TAG = "<|python_tag|>"
# Text that does not begin (after whitespace) like a call.
TEXT = r"/(.|\n)+/ & ~/[ \t\r\n]*(\{|<\|python_tag\|>)(.|\n)*/"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    template = "llama3_json"
    args_key = "parameters"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        rest = text[i:]
        if rest.startswith(PYTHON_TAG):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(rest):  # nothing yet, or part of the tag
            return ParsedOutput("")
        elif not rest.startswith("{"):
            return ParsedOutput(visible_text(text, final))
        return ParsedOutput("", json_calls(text, i, final, ";"))

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        more = ' ("; " body)*' if parallel else ""
        start = f"start: body{more}" if required else f"start: TEXT | body{more}\nTEXT: {TEXT}"
        return "\n".join([start, self.body_rules(tools)])
