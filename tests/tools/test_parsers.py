"""Every tool-call parser on sample outputs: the whole-text parse finds the expected calls, and the same text
streamed split at every character boundary (and one character at a time) gives deltas that reassemble to
exactly that parse: content, names and arguments, no piece lost or repeated."""

from __future__ import annotations

import json

import pytest

from services.tokenizer.openai.tools.parser import get_parser
from services.tokenizer.openai.tools.streaming import ToolCallStream

W = {"city": "Paris", "unit": "celsius"}
NESTED = {"q": 'a "quoted" } ] { [ text', "filters": {"tags": ["x", "y"], "n": [1, 2.5, -3e2]}, "ok": True}
# parser -> [(model text, expected content, expected [(name, arguments as parsed JSON)])]
SAMPLES: dict[str, list[tuple[str, str, list[tuple[str, dict]]]]] = {
    "hermes": [
        ("Just text, no call.", "Just text, no call.", []),
        (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
            "",
            [("get_weather", W)],
        ),
        (
            'Let me look.\n<tool_call>\n{"name": "search", "arguments": ' + json.dumps(NESTED) + "}\n</tool_call>\n"
            '<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
            "Let me look.",
            [("search", NESTED), ("now", {})],
        ),
        ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
        ("<tool_call>\nnot json", "<tool_call>\nnot json", []),
        ('<tool_call>{"name":"f","arguments":{"a":[1,{"b":"}"}]}}</tool_call>', "", [("f", {"a": [1, {"b": "}"}]})]),
    ],
    "llama3_json": [
        ("Plain answer.", "Plain answer.", []),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', "", [("get_weather", W)]),
        (
            '<|python_tag|>{"name": "search", "parameters": '
            + json.dumps(NESTED)
            + '}; {"name": "now", "parameters": {}}',
            "",
            [("search", NESTED), ("now", {})],
        ),
        ("  {x", "", []),
    ],
    "mistral": [
        ("No tools here [really].", "No tools here [really].", []),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
            "",
            [("get_weather", W)],
        ),
        (
            'Sure. [TOOL_CALLS] [{"name": "search", "arguments": '
            + json.dumps(NESTED)
            + '}, {"name": "now", "arguments": {}}]',
            "Sure.",
            [("search", NESTED), ("now", {})],
        ),
        ('[{"name": "now", "arguments": {}}]', "", [("now", {})]),
        ("[1, 2]", "[1, 2]", []),
    ],
    "pythonic": [
        ("Plain answer [with brackets].", "Plain answer [with brackets].", []),
        ('[get_weather(city="Paris", unit="celsius")]', "", [("get_weather", W)]),
        (
            "<|python_start|>[search(q='a \\'quoted\\' } ] ) ( text',"
            " filters={'tags': ('x', \"y\"), 'n': [1, 2.5, -3e2]}, ok=True), now()]<|python_end|>",
            "",
            [
                (
                    "search",
                    {
                        "q": "a 'quoted' } ] ) ( text",
                        "filters": {"tags": ["x", "y"], "n": [1, 2.5, -300.0]},
                        "ok": True,
                    },
                ),
                ("now", {}),
            ],
        ),
        (
            '[f(a="""x""", b=\'\', c=None, d=null, e=false)]',
            "",
            [("f", {"a": "x", "b": "", "c": None, "d": None, "e": False})],
        ),
        ("[1, 2]", "[1, 2]", []),
        ("[get_weather is nice]", "[get_weather is nice]", []),
    ],
}
CASES = [
    pytest.param(name, *sample, id=f"{name}-{i}")
    for name, samples in SAMPLES.items()
    for i, sample in enumerate(samples)
]


def streamed(parser_name: str, pieces: list[str]) -> tuple[str, list[dict]]:
    """Content and calls reassembled from the deltas of ``pieces`` pushed one by one."""
    stream = ToolCallStream(get_parser(parser_name))
    content, calls = "", []
    for i, piece in enumerate(pieces):
        delta = stream.push(piece, final=i == len(pieces) - 1)
        content += delta.content
        for call in delta.calls:
            if call.name is not None:
                assert call.index == len(calls), "a call's first delta comes once, in order"
                assert call.id and call.id.startswith("call_")
                calls.append({"name": call.name, "arguments": call.arguments})
            else:
                calls[call.index]["arguments"] += call.arguments
    return content, calls


@pytest.mark.parametrize(("parser_name", "text", "content", "expected"), CASES)
def test_whole_text(parser_name, text, content, expected):
    parsed = get_parser(parser_name).parse(text, final=True)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == expected
    assert all(c.complete for c in parsed.calls)


@pytest.mark.parametrize(("parser_name", "text", "content", "expected"), CASES)
def test_streamed_at_every_boundary(parser_name, text, content, expected):
    whole = get_parser(parser_name).parse(text, final=True)
    want = (whole.content, [{"name": c.name, "arguments": c.arguments} for c in whole.calls])
    for cut in range(len(text) + 1):
        assert streamed(parser_name, [text[:cut], text[cut:]]) == want, f"split at {cut}"
    assert streamed(parser_name, list(text)) == want
    for size in (2, 3, 7):
        assert streamed(parser_name, [text[i : i + size] for i in range(0, len(text), size)]) == want


@pytest.mark.parametrize("parser_name", sorted(SAMPLES))
def test_prefix_readings_continue(parser_name):
    """Every reading of a prefix is a prefix of the whole reading (the promise streaming rests on)."""
    parser = get_parser(parser_name)
    for text, _, _ in SAMPLES[parser_name]:
        whole = parser.parse(text, final=True)
        for cut in range(len(text)):
            part = parser.parse(text[:cut], final=False)
            assert whole.content.startswith(part.content), (text[:cut], part)
            assert len(part.calls) <= len(whole.calls)
            for got, final in zip(part.calls, whole.calls, strict=False):
                assert got.name == final.name and final.arguments.startswith(got.arguments), (text[:cut], got)


def test_truncated_call_is_kept_incomplete():
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "unfinish'
    parsed = get_parser("hermes").parse(text, final=True)
    assert [(c.name, c.arguments, c.complete) for c in parsed.calls] == [("f", '{"a": "unfinish', False)]
    assert streamed("hermes", list(text)) == ("", [{"name": "f", "arguments": '{"a": "unfinish'}])


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'; one of hermes"):
        get_parser("nope")


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ("[f(a=1, b=g())]", '{"a": 1'),  # a call is not a literal: the call ends unfinished there
        ("[f(a=1, b=__import__('os'))]", '{"a": 1'),
        ("[f(a=1, b={1, 2})]", '{"a": 1'),  # a set has no JSON form
        ("[f(a=1e999)]", "{"),  # nor has infinity
        ('[f(a="x", "y")]', '{"a": "x"'),  # positional arguments are not read
    ],
)
def test_pythonic_reads_literals_only(text, arguments):
    (call,) = get_parser("pythonic").parse(text, final=True).calls
    assert (call.name, call.arguments, call.complete) == ("f", arguments, False)
    assert streamed("pythonic", list(text)) == ("", [{"name": "f", "arguments": arguments}])
