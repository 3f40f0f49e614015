"""Where JSON values begin and end in text that may stop anywhere: what the tool-call parsers need to find a
call's name and its arguments' exact characters in a stream that is still being written.

Nothing here decodes numbers or rebuilds objects: the arguments a client gets are the model's own characters,
so a streamed prefix is always a prefix of the final text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_CLOSE = {"{": "}", "[": "]"}


class Malformed(ValueError):
    """The text cannot be the start of the JSON expected here."""


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """``text[i]`` opens a string: the index after its closing quote, None when the text ends first."""
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def value_end(text: str, i: int, final: bool = False) -> int | None:
    """The index after the JSON value starting at ``text[i]`` (not whitespace); None when the text ends first.
    A bare scalar (number, true, false, null) ends at the first character that cannot continue it; at the end
    of the text it ends there only when ``final``. Brackets are matched, strings skipped; the value's contents
    are not checked."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in _CLOSE:
        stack = [_CLOSE[c]]
        j = i + 1
        while j < len(text):
            c = text[j]
            if c == '"':
                end = string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            if c in _CLOSE:
                stack.append(_CLOSE[c])
            elif c in "}]":
                if c != stack.pop():
                    raise Malformed(f"unbalanced {c!r}")
                if not stack:
                    return j + 1
            j += 1
        return None
    if c in "-0123456789tfn":
        j = i
        while j < len(text) and (text[j].isalnum() or text[j] in "+-."):
            j += 1
        return j if j < len(text) or final else None
    raise Malformed(f"a JSON value cannot start with {c!r}")


@dataclass(slots=True)
class Member:
    key: str
    value_start: int  # where the value's first character is (or would be)
    value_end: int | None  # None: the text ends inside the value


@dataclass(slots=True)
class ObjectScan:
    members: list[Member]
    end: int | None  # the index after the closing brace; None: the object is not closed yet


def scan_object(text: str, i: int, final: bool = False) -> ObjectScan:
    """The members of the JSON object whose ``{`` is at ``text[i]``, as far as the text goes. Raises
    ``Malformed`` when the text cannot be such an object."""
    if text[i] != "{":
        raise Malformed("expected an object")
    members: list[Member] = []
    j = skip_ws(text, i + 1)
    if j < len(text) and text[j] == "}":
        return ObjectScan(members, j + 1)
    while j < len(text):
        if text[j] != '"':
            raise Malformed("expected a key")
        key_end = string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise Malformed("expected ':'")
        start = skip_ws(text, j + 1)
        end = value_end(text, start, final) if start < len(text) else None
        members.append(Member(key, start, end))
        if end is None:
            break
        j = skip_ws(text, end)
        if j >= len(text):
            break
        if text[j] == "}":
            return ObjectScan(members, j + 1)
        if text[j] != ",":
            raise Malformed("expected ',' or '}'")
        j = skip_ws(text, j + 1)
    return ObjectScan(members, None)
