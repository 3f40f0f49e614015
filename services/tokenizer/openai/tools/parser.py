"""What every tool-call parser does, and the registry ``--tool-call-parser`` chooses from.

A parser reads the model's whole text so far: ``parse(text, final=False)`` while it is still being written,
``parse(text, final=True)`` once it ended. Its one promise, on which streaming rests: for any prefix of a text,
the content and each call's name and arguments found with ``final=False`` are prefixes of (names: equal to)
those found in the whole text with ``final=True``. So a parser holds back what it cannot yet place (a partial
``<tool_call>`` tag, trailing whitespace, an object whose name has not come), and takes a call's arguments as
the model's own characters.
"""

from __future__ import annotations

import json
from typing import ClassVar

from services.common.structured_output import JSON_OPTIONS
from services.tokenizer.openai.tools.json_scan import Malformed, scan_object
from services.tokenizer.openai.tools.types import FunctionTool, ParsedOutput, ToolCall

ARGUMENT_KEYS = ("arguments", "parameters")


class ToolParser:
    name: ClassVar[str]
    template: ClassVar[str]  # the shipped chat template (templates/<name>.jinja) that writes this format
    args_key: ClassVar[str] = "arguments"  # the key of the arguments in a call the grammar writes

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for the model's answer: one call or more (``parallel``) of
        ``tools`` when ``required``, else free text or such calls."""
        raise NotImplementedError

    def body_rules(self, tools: list[FunctionTool]) -> str:
        """Lark rules of ``body``: one call's JSON object, its arguments held to the tool's schema."""
        names = [f"body_{i}" for i in range(len(tools))]
        rules = [f"body: {' | '.join(names)}"]
        rules += [f"{name}: %json {compact(self.call_schema(tool))}" for name, tool in zip(names, tools, strict=True)]
        return "\n".join(rules)

    def call_schema(self, tool: FunctionTool) -> dict:
        parameters = closed_schema(tool.parameters or {"type": "object"})
        return {
            "x-guidance": {**JSON_OPTIONS, "lenient": True},  # keywords llguidance lacks are ignored
            **root_definitions(parameters),  # "#/$defs/..." references resolve from the root
            "type": "object",
            "properties": {"name": {"const": tool.name}, self.args_key: parameters},
            "required": ["name", self.args_key],
            "additionalProperties": False,
        }


DEFINITIONS = ("$defs", "definitions")
_NOT_SCHEMAS = frozenset({"enum", "const", "default", "examples", "required"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def compact(schema: dict) -> str:
    """A schema as the shortest JSON text: grammars are held to ``MAX_SPEC_CHARS``."""
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def root_definitions(schema: dict) -> dict:
    """The ``$defs`` / ``definitions`` of ``schema``, which its ``#/...`` references name from its root."""
    return {key: schema[key] for key in DEFINITIONS if key in schema}


def closed_schema(schema):
    """``schema`` with every object schema that lists ``properties`` and says nothing of others closed
    (``additionalProperties: false``), as OpenAI's strict function calling closes them: the grammar lets
    the model write the arguments a function declares, not keys it invents (a small model invents them
    until ``max_tokens``). A schema that allows other properties explicitly keeps them."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # name -> schema
            out[key] = {name: closed_schema(item) for name, item in value.items()}
        else:
            out[key] = value if key in _NOT_SCHEMAS else closed_schema(value)
    if isinstance(schema.get("properties"), dict) and not {"additionalProperties", "patternProperties"} & set(schema):
        out["additionalProperties"] = False
    return out


def held_suffix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def visible_text(text: str, final: bool, marker: str = "") -> str:
    """Content that may be sent while the text is still being written: all of it at the end, else without
    trailing whitespace (it is dropped before a call) and without a partial ``marker``."""
    if final:
        return text
    if marker:
        text = text[: len(text) - held_suffix(text, marker)]
    return text.rstrip()


def json_call(text: str, start: int, final: bool) -> tuple[ToolCall | None, int | None]:
    """The call in the JSON object at ``text[start]`` (``{"name": ..., "arguments": {...}}``, or
    ``"parameters"``) and the index after the object (None when it is not closed). The call is None while its
    name has not come (or never does). Raises ``Malformed``."""
    scan = scan_object(text, start, final)
    name = None
    arguments = ""
    for member in scan.members:
        if member.key == "name" and member.value_end is not None:
            value = json.loads(text[member.value_start : member.value_end])
            if not isinstance(value, str):
                raise Malformed("a call's name is a string")
            name = value
        elif member.key in ARGUMENT_KEYS:
            end = member.value_end if member.value_end is not None else len(text)
            arguments = text[member.value_start : end]
    if name is None:
        return None, scan.end
    if scan.end is not None and not arguments:
        arguments = "{}"
    return ToolCall(name, arguments, complete=scan.end is not None), scan.end


def json_calls(text: str, start: int, final: bool, separators: str) -> list[ToolCall]:
    """Calls written as JSON objects one after another from ``text[start]``, separated by whitespace and
    any of ``separators``; stops at the first thing that is not one."""
    calls: list[ToolCall] = []
    i = start
    while i < len(text) and text[i] == "{":
        try:
            call, end = json_call(text, i, final)
        except Malformed:
            break
        if call is None:
            break
        calls.append(call)
        if end is None:
            break
        i = end
        while i < len(text) and (text[i] in " \t\r\n" or text[i] in separators):
            i += 1
    return calls


def get_parser(name: str) -> ToolParser:
    from services.tokenizer.openai.tools.parsers import PARSERS

    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; one of {', '.join(sorted(PARSERS))}")
    return PARSERS[name]()
