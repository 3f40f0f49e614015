"""The grammars that enforce ``tool_choice``, run by llguidance over a small byte-level vocabulary: each parser's
grammar compiles for the twenty test schemas, and the pythonic grammar takes exactly the calls whose keyword
arguments fit the schema (required ones present, in order, values valid) and, under ``auto``, plain text."""

from __future__ import annotations

import pytest

from services.common.structured_output import build_tokenizer, grammar_error, new_matcher
from services.tokenizer.openai.tools.parser import get_parser
from services.tokenizer.openai.tools.parsers import PARSERS
from services.tokenizer.openai.tools.types import FunctionTool
from tests.tools.schemas import TOOLS
from tests.worker.tiny import tiny_bytelevel_tokenizer

FUNCTIONS = [FunctionTool(t["function"]["name"], "", t["function"]["parameters"]) for t in TOOLS]
# Optional members around a required one, and a value given by reference to the schema's $defs.
OPTIONAL = FunctionTool(
    "find",
    parameters={
        "type": "object",
        "$defs": {"Place": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
        "properties": {"a": {"type": "integer"}, "where": {"$ref": "#/$defs/Place"}, "c": {"type": "boolean"}},
        "required": ["where"],
    },
)


@pytest.fixture(scope="module")
def vocab():
    return build_tokenizer(tiny_bytelevel_tokenizer().to_str(), 300, [262])


def accepts(vocab, grammar: str, text: str) -> bool:
    matcher = new_matcher(vocab, grammar)
    ids = vocab.tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parser_name", sorted(PARSERS))
@pytest.mark.parametrize("required", [True, False], ids=["required", "auto"])
def test_grammar_compiles_for_every_schema(vocab, parser_name, required):
    grammar = get_parser(parser_name).grammar(FUNCTIONS, required, parallel=True)
    assert grammar_error(grammar, vocab) == ""


@pytest.mark.parametrize(
    ("text", "required", "auto"),
    [
        ('[get_weather(city="Paris", unit="celsius")]', True, True),
        ('[add(a=1, b=2), get_weather(city="Oslo", unit="fahrenheit")]', True, True),
        ('[find(where={"x": 1})]', True, True),
        ('[find(a=-3, where={"x": 1}, c=true)]', True, True),
        ("Just text.", False, True),
        ("[add(a=1)]", False, False),  # a required argument left out
        ("[add(b=2, a=1)]", False, False),  # out of the schema's order
        ("[add(1, 2)]", False, False),  # positional
        ('[get_weather(city="Paris", unit="kelvin")]', False, False),  # not in the enum
        ('[find(where={"y": 1})]', False, False),  # the $ref'd schema holds
        ("[nope()]", False, False),  # not a tool
        ('[find(where={"x": 1, "y": 2})]', False, False),  # a nested object is closed
    ],
)
def test_pythonic_grammar(vocab, text, required, auto):
    tools = [FUNCTIONS[0], FUNCTIONS[1], OPTIONAL]
    parser = get_parser("pythonic")
    assert accepts(vocab, parser.grammar(tools, True, parallel=True), text) is required
    assert accepts(vocab, parser.grammar(tools, False, parallel=True), text) is auto
    if required:  # what the grammar lets through parses into complete calls
        assert all(c.complete for c in parser.parse(text, final=True).calls)


def test_pythonic_named_single_call(vocab):
    grammar = get_parser("pythonic").grammar([FUNCTIONS[1]], True, parallel=False)
    assert accepts(vocab, grammar, "[add(a=1, b=2)]")
    assert not accepts(vocab, grammar, "[add(a=1, b=2), add(a=3, b=4)]")
    assert not accepts(vocab, grammar, '[get_weather(city="Paris", unit="celsius")]')


@pytest.mark.parametrize(
    ("arguments", "valid"),
    [
        ('{"where": {"x": 1}}', True),
        ('{"a": 2, "where": {"x": 1}, "c": false}', True),
        ('{"where": {"y": 1}}', False),  # the $ref'd schema holds: "#/$defs/Place" resolves from the call's root
        ('{"where": {"x": 1}, "invented": 1}', False),  # an object schema that lists properties is closed
        ('{"where": {"x": 1, "invented": 1}}', False),  # nested ones too
    ],
)
def test_json_call_arguments_are_held_to_the_closed_schema(vocab, arguments, valid):
    grammar = get_parser("hermes").grammar([OPTIONAL], True, parallel=False)
    text = '<tool_call>\n{"name": "find", "arguments": ' + arguments + "}\n</tool_call>"
    assert accepts(vocab, grammar, text) is valid


def test_open_objects_stay_open(vocab):
    """An object schema with no properties listed, or one that allows others, takes any keys."""
    free = FunctionTool(
        "tag",
        parameters={
            "type": "object",
            "properties": {"meta": {"type": "object"}, "extra": {"properties": {}, "additionalProperties": True}},
        },
    )
    grammar = get_parser("hermes").grammar([free], True, parallel=False)
    arguments = '{"meta": {"any": 1}, "extra": {"k": "v"}}'
    assert accepts(vocab, grammar, '<tool_call>\n{"name": "tag", "arguments": ' + arguments + "}\n</tool_call>")
    assert accepts(vocab, get_parser("pythonic").grammar([free], True, False), '[tag(meta={"any": 1})]')
