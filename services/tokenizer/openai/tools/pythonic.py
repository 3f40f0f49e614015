"""Pythonic calls (Llama 3.2, Llama 4): the answer is either text or a Python list of calls with keyword
arguments, ``[get_weather(city="Paris"), now()]``, optionally between ``<|python_start|>`` and
``<|python_end|>``.

Argument values are Python literals read with ``ast`` and never evaluated (strings, numbers, True/False/None,
lists, tuples, dicts); JSON's ``true``, ``false`` and ``null`` are read as well, since the grammar that
enforces ``tool_choice`` writes each value as JSON. A call's arguments are JSON the parser builds one keyword
at a time, so while a call is written they grow by whole members (``{"city": "Paris"``, then
``, "unit": "celsius"``, then ``}``): each reading is a prefix of the next, as streaming needs.
"""

from __future__ import annotations

import ast
import json
import re
import warnings

from services.common.structured_output import JSON_OPTIONS
from services.tokenizer.openai.tools.json_scan import Malformed, skip_ws
from services.tokenizer.openai.tools.parser import (
    ToolParser,
    closed_schema,
    compact,
    root_definitions,
    visible_text,
)
from services.tokenizer.openai.tools.types import FunctionTool, ParsedOutput, ToolCall

START_TAG = "<|python_start|>"
CALL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")  # a tool's name (kvgrid allows '.' and '-' in names)
KEYWORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
JSON_NAMES = {"true": True, "false": False, "null": None}
# Text that does not begin (after whitespace) like a list of calls.
TEXT = r"/(.|\n)+/ & ~/[ \t\r\n]*(\[|<\|python_start\|>)(.|\n)*/"


class PythonicParser(ToolParser):
    name = "pythonic"
    template = "pythonic"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        rest = text[i:]
        if rest.startswith(START_TAG):
            i = skip_ws(text, i + len(START_TAG))
        elif not final and START_TAG.startswith(rest):  # nothing yet, or part of the tag
            return ParsedOutput("")
        if i >= len(text) or text[i] != "[":
            return ParsedOutput(visible_text(text, final) if i < len(text) else (text if final else ""))
        calls = scan_calls(text, i + 1)
        if not calls:  # a list, or the start of one, that holds no call (yet): text, once the text is over
            return ParsedOutput(text if final else "")
        return ParsedOutput("", calls)

    def grammar(self, tools: list[FunctionTool], required: bool, parallel: bool) -> str:
        more = ' (", " call)*' if parallel else ""
        names = [f"call_{i}" for i in range(len(tools))]
        rules = [f'calls: "[" call{more} "]"', f"call: {' | '.join(names)}"]
        for name, tool in zip(names, tools, strict=True):
            rules += call_rules(name, tool)
        start = "start: calls" if required else f"start: TEXT | calls\nTEXT: {TEXT}"
        return "\n".join([start, *rules])


def call_rules(rule: str, tool: FunctionTool) -> list[str]:
    """Lark rules of ``rule``: ``name(key=value, ...)`` with the schema's properties in its order, the required
    ones always, each value JSON held to its property's schema (with the schema's ``$defs``)."""
    schema = closed_schema(tool.parameters or {})
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    defs = root_definitions(schema)
    keys = list(properties)
    out = [f'{rule}: {json.dumps(tool.name + "(")} {rule}_f0 ")"']
    # f<k>: the arguments from property k on, none written yet; m<k>: the same after one was written.
    out.append(f'{rule}_f{len(keys)}: ""')
    out.append(f'{rule}_m{len(keys)}: ""')
    for k in reversed(range(len(keys))):
        key, sub = keys[k], properties[keys[k]]
        value_schema = dict(sub) if isinstance(sub, dict) else {}
        value_schema = {"x-guidance": {**JSON_OPTIONS, "lenient": True}, **defs, **value_schema}
        out.append(f"{rule}_v{k}: %json {compact(value_schema)}")
        member = f"{json.dumps(key + '=')} {rule}_v{k}"
        nxt_f, nxt_m = f"{rule}_f{k + 1}", f"{rule}_m{k + 1}"
        if key in required:
            out.append(f"{rule}_f{k}: {member} {nxt_m}")
            out.append(f'{rule}_m{k}: ", " {member} {nxt_m}')
        else:
            out.append(f"{rule}_f{k}: {member} {nxt_m} | {nxt_f}")
            out.append(f'{rule}_m{k}: ", " {member} {nxt_m} | {nxt_m}')
    return out


def scan_calls(text: str, i: int) -> list[ToolCall]:
    """The calls of the list whose items start at ``text[i]``, as far as the text goes; stops at the first
    thing that is not a call."""
    calls: list[ToolCall] = []
    while True:
        i = skip_ws(text, i)
        m = CALL_NAME.match(text, i)
        if m is None:
            break
        j = skip_ws(text, m.end())
        if j >= len(text) or text[j] != "(":  # the name may go on, or this is not a call
            break
        call, end = scan_call(text, m.group(), j + 1)
        calls.append(call)
        if end is None:
            break
        i = skip_ws(text, end)
        if i >= len(text) or text[i] != ",":
            break
        i += 1
    return calls


def scan_call(text: str, name: str, i: int) -> tuple[ToolCall, int | None]:
    """The call whose ``(`` ends at ``text[i - 1]`` and the index after its ``)`` (None when the text ends
    inside it or it stops being well-formed: then its arguments are the members read so far, unclosed)."""
    members: list[str] = []
    j = skip_ws(text, i)
    while j < len(text):
        if text[j] == ")":
            return ToolCall(name, "{" + ", ".join(members) + "}"), j + 1
        m = KEYWORD.match(text, j)
        if m is None:
            break
        k = skip_ws(text, m.end())
        if k >= len(text) or text[k] != "=":
            break
        start = k + 1
        try:
            end = literal_end(text, start)
            if end is None:
                break
            value = read_literal(text[start:end])
            member = json.dumps(m.group()) + ": " + json.dumps(value, ensure_ascii=False, allow_nan=False)
        except (Malformed, ValueError):
            break
        members.append(member)
        j = end if text[end] == ")" else skip_ws(text, end + 1)
    return ToolCall(name, "{" + ", ".join(members), complete=False), None


def literal_end(text: str, i: int) -> int | None:
    """The index of the ``,`` or ``)`` that ends the value starting at ``text[i]`` (brackets matched, strings
    skipped); None when the text ends first. Raises ``Malformed`` for an unbalanced bracket."""
    closers: list[str] = []
    j = i
    while j < len(text):
        c = text[j]
        if c in "\"'":
            end = string_end(text, j)
            if end is None:
                return None
            j = end
            continue
        if c in "([{":
            closers.append({"(": ")", "[": "]", "{": "}"}[c])
        elif c in ")]}":
            if not closers:
                if c == ")":
                    return j
                raise Malformed(f"unbalanced {c!r}")
            if c != closers.pop():
                raise Malformed(f"unbalanced {c!r}")
        elif c == "," and not closers:
            return j
        j += 1
    return None


def string_end(text: str, i: int) -> int | None:
    """``text[i]`` opens a Python string (single or triple quoted): the index after it ends, None when the text
    ends first (or before telling ``''`` from ``'''``)."""
    quote = text[i]
    if text.startswith(quote * 3, i):
        close, j = quote * 3, i + 3
    elif text[i + 1 : i + 3] in ("", quote):  # the text ends before the opening is known
        return None
    else:
        close, j = quote, i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
        elif text.startswith(close, j):
            return j + len(close)
        else:
            j += 1
    return None


def read_literal(source: str):
    """The JSON value of one Python literal; raises ``Malformed`` for anything else (a name, a call, ...)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences ("\/") warn
            tree = ast.parse(source.strip(), mode="eval")
        return _value(tree.body)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise Malformed(f"not a literal: {exc}") from exc


def _value(node: ast.AST):
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, str):
            return _joined_surrogates(value)
        if value is None or isinstance(value, bool | int | float):
            return value
    elif isinstance(node, ast.List | ast.Tuple):
        return [_value(item) for item in node.elts]
    elif isinstance(node, ast.Dict):
        out = {}
        for key, item in zip(node.keys, node.values, strict=True):
            name = None if key is None else _value(key)
            if not isinstance(name, str):
                raise Malformed("dictionary keys are strings")
            out[name] = _value(item)
        return out
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _value(node.operand)
        if isinstance(operand, int | float) and not isinstance(operand, bool):
            return -operand if isinstance(node.op, ast.USub) else operand
    elif isinstance(node, ast.Name) and node.id in JSON_NAMES:
        return JSON_NAMES[node.id]
    raise Malformed(f"not a literal: {type(node).__name__}")


def _joined_surrogates(value: str) -> str:
    """JSON's escaped surrogate pairs ("\\ud83d\\ude00") as the one character they mean in JSON."""
    if not any("\ud800" <= c <= "\udfff" for c in value):
        return value
    try:
        return value.encode("utf-16", "surrogatepass").decode("utf-16")
    except UnicodeDecodeError as exc:
        raise Malformed("a lone surrogate") from exc
