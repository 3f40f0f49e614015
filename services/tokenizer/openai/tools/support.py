"""What the front door does with a chat request's tools: check them, choose the template that renders them,
and turn ``tool_choice`` into the grammar the worker applies.

A model whose own chat template writes tools (it reads ``tools``, as transformers' templates do) renders them
itself; otherwise the template shipped with the tool-call parser does (``hermes``: ChatML), so the model's
answer comes in the format the parser reads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from kvgrid.v1 import common_pb2
from services.common.errors import InvalidArgument
from services.common.structured_output import JSON_OPTIONS, MAX_SPEC_CHARS
from services.tokenizer.grammar_check import GrammarChecker
from services.tokenizer.openai.tools.grammar import tool_grammar
from services.tokenizer.openai.tools.parser import DEFINITIONS, ToolParser, compact, get_parser, root_definitions
from services.tokenizer.openai.tools.templates import shipped_template
from services.tokenizer.openai.tools.types import ToolRequest

DEFAULT_PARSER = "hermes"
MAX_TOOLS = 128
# Nesting of a tool's parameters schema (JSON objects and arrays, a property costing two: its schema and the
# ``properties`` map): llguidance refuses schemas past about 150, and kvgrid's own walks of a schema recurse.
MAX_SCHEMA_DEPTH = 100
MAX_VALUE_CHECKS = 64  # a request's string constraints checked on their own (``check_tool_values``)
STRING_KEYS = frozenset({"pattern", "format", "minLength", "maxLength"})
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for function names (a dot allowed, as vLLM does)


@dataclass(slots=True)
class ToolSupport:
    """The served model's tool calling: the parser of its calls and the template that writes tools for it."""

    parser: ToolParser
    template_source: str

    @classmethod
    def named(cls, parser_name: str = DEFAULT_PARSER) -> ToolSupport:
        """Raises ValueError for an unknown parser."""
        parser = get_parser(parser_name)
        return cls(parser, shipped_template(parser.template))

    def sampling(self, request: ToolRequest, sampling: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
        """``sampling`` with the grammar ``tool_choice`` asks for (a copy), or ``sampling`` itself when the
        output is free. A structured output of the client's own and ``auto`` keep theirs (the output is still
        read for calls); with ``required`` or a named function it is an error."""
        grammar = tool_grammar(self.parser, request)
        if grammar is None:
            return sampling
        if sampling.WhichOneof("structured_output") is not None:
            if request.choice.mode == "auto":
                return sampling
            raise InvalidArgument(
                "tool_choice", f"{request.choice.mode!r} cannot be combined with a structured output (response_format)"
            )
        if len(grammar) > MAX_SPEC_CHARS:  # the worker compiles no longer grammar either
            raise InvalidArgument(
                "tools",
                f"the grammar that holds the model to these tools would be {len(grammar)} characters, at most"
                f" {MAX_SPEC_CHARS} are accepted: offer fewer tools or smaller schemas (long enums, many properties)",
            )
        out = common_pb2.SamplingParams()
        out.CopyFrom(sampling)
        out.grammar = grammar
        return out


def check_tools(request: ToolRequest, field: str = "tools") -> None:
    """Names well-formed and distinct, parameters a JSON object schema, a named choice among the tools."""
    if len(request.tools) > MAX_TOOLS:
        raise InvalidArgument(field, f"at most {MAX_TOOLS} tools, got {len(request.tools)}")
    seen: set[str] = set()
    for i, tool in enumerate(request.tools):
        if not NAME.fullmatch(tool.name):
            raise InvalidArgument(
                f"{field}[{i}].function.name", f"1 to 64 letters, digits, '_', '.' or '-', got {tool.name!r}"
            )
        if tool.name in seen:
            raise InvalidArgument(f"{field}[{i}].function.name", f"{tool.name!r} is given twice")
        seen.add(tool.name)
        if not isinstance(tool.parameters, dict) or tool.parameters.get("type", "object") != "object":
            raise InvalidArgument(f"{field}[{i}].function.parameters", "must be a JSON schema of an object")
        depth = json_depth(tool.parameters)
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidArgument(
                f"{field}[{i}].function.parameters",
                f"nested {depth} levels deep (JSON objects and arrays); at most {MAX_SCHEMA_DEPTH}",
            )
    mode = request.choice.mode
    if mode in ("required", "function") and not request.tools:
        raise InvalidArgument("tool_choice", f"{mode if mode != 'function' else 'a named function'} needs tools")
    if mode == "function" and request.choice.name not in seen:
        raise InvalidArgument("tool_choice", f"names {request.choice.name!r}, which is not among the tools")


def check_tool_values(request: ToolRequest, grammars: GrammarChecker) -> None:
    """Each string a tool's schema constrains (``pattern``, ``format``, a length), checked on its own against
    llguidance's lexer budget: a grammar's check probes only its first tokens, and a call's later arguments
    lie beyond them, where a costly pattern would slow every step of the engine or fail the call halfway.
    At most ``MAX_VALUE_CHECKS`` distinct ones per request (each costs up to the fuel budget, milliseconds)."""
    if not request.active:
        return
    offered = {tool.name for tool in request.offered()}
    seen: set[str] = set()
    for i, tool in enumerate(request.tools):
        if tool.name not in offered:
            continue
        defs = root_definitions(tool.parameters)
        for value in _string_schemas(tool.parameters):
            spec = compact({"x-guidance": {**JSON_OPTIONS, "lenient": True}, **defs, **value})
            if spec in seen or len(seen) >= MAX_VALUE_CHECKS:
                continue
            seen.add(spec)
            _, problem = grammars.problem(common_pb2.SamplingParams(json_schema=spec))
            if problem:
                raise InvalidArgument(f"tools[{i}].function.parameters", f"{compact(value)[:120]}: {problem}")


def _string_schemas(schema) -> list[dict]:
    """The subschemas of ``schema`` that constrain a string's characters, found without recursion."""
    out, stack = [], [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            kind = item.get("type", "string")
            if STRING_KEYS & set(item) and (kind == "string" or isinstance(kind, list) and "string" in kind):
                out.append({k: v for k, v in item.items() if k not in DEFINITIONS})
            stack.extend(v for k, v in item.items() if k not in ("enum", "const", "default", "examples"))
    return out


def json_depth(value) -> int:
    """How deeply JSON objects and arrays nest in ``value`` (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def template_tool_calls(calls: list[tuple[str, str, str]]) -> list[dict]:
    """An assistant turn's calls (id, name, arguments as JSON text) as chat templates read them: arguments as
    an object where they parse (templates write them with ``tojson``), else as the text given."""
    out = []
    for call_id, name, arguments in calls:
        try:
            value = json.loads(arguments) if arguments else {}
        except json.JSONDecodeError:
            value = arguments
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": value}})
    return out


def needs_tool_template(messages: list[dict], tools: list[dict] | None) -> bool:
    """Whether rendering needs a template that writes tools: tools offered, or calls and results in the history."""
    return bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
