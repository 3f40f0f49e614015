"""SamplingParams.structured_output as llguidance grammars: the one translation the frontend (which checks
a spec) and the worker (which compiles and applies it) share, so both read a spec the same way.

llguidance (Rust, no torch) compiles JSON schemas, regexes, choices and Lark/GBNF grammars against the
model's vocabulary and computes a token mask per step in microseconds. The scheduler never imports this.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import llguidance

from kvgrid.v1 import common_pb2

# JSON is written with ", " and ": " and no other whitespace: a small model that may put whitespace
# anywhere can pad with newlines until max_tokens instead of closing the value.
JSON_OPTIONS: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
MAX_SPEC_CHARS = 65536
MAX_CHOICES = 1024
MAX_ERROR_CHARS = 400
T = TypeVar("T")


class SpecError(ValueError):
    """A structured-output spec that cannot be used; ``field`` names it in SamplingParams."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def constraint_kind(params: common_pb2.SamplingParams) -> str | None:
    """The field of the ``structured_output`` oneof that is set, or None."""
    return params.WhichOneof("structured_output")


def spec_key(params: common_pb2.SamplingParams) -> tuple[str, str] | None:
    """A hashable identity of the constraint (kind, spec text): equal keys compile to the same grammar."""
    kind = constraint_kind(params)
    if kind is None:
        return None
    if kind == "choice":
        return kind, json.dumps(list(params.choice.choices))
    return kind, str(getattr(params, kind))


def grammar_for(params: common_pb2.SamplingParams) -> str | None:
    """The llguidance grammar of the request's constraint (None without one); raises SpecError when the
    spec cannot even be read. Whether the grammar compiles is ``grammar_error``'s question."""
    kind = constraint_kind(params)
    if kind is None:
        return None
    field = f"sampling.{kind}"
    if kind == "json_object":
        if not params.json_object:
            raise SpecError(field, "must be true when set")
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "choice":
        return _choice_grammar(field, list(params.choice.choices))
    text = getattr(params, kind)
    if not text:
        raise SpecError(field, "must not be empty")
    if len(text) > MAX_SPEC_CHARS:
        raise SpecError(field, f"at most {MAX_SPEC_CHARS} characters, got {len(text)}")
    if kind == "json_schema":
        return _schema_grammar(field, text)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    try:  # Lark, or GBNF/EBNF (converted to Lark)
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise SpecError(field, _short(str(exc))) from exc


def _schema_grammar(field: str, text: str) -> str:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(field, f"not valid JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise SpecError(field, f"a JSON schema must be a JSON object ({{}} allows any value), not {json.dumps(schema)}")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except ValueError as exc:
        raise SpecError(field, _short(str(exc))) from exc


def _choice_grammar(field: str, choices: list[str]) -> str:
    if not choices:
        raise SpecError(field, "must list at least one choice")
    if len(choices) > MAX_CHOICES:
        raise SpecError(field, f"at most {MAX_CHOICES} choices, got {len(choices)}")
    for i, choice in enumerate(choices):
        if not choice:
            raise SpecError(f"{field}[{i}]", "must not be empty")
    # Lark string literals read JSON string escapes.
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


def grammar_error(grammar: str, tokenizer: llguidance.LLTokenizer | None) -> str:
    """'' when ``grammar`` compiles (against ``tokenizer``'s vocabulary when given), else the problem."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    return _short(messages[0]) if is_error else ""


def build_tokenizer(tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
    """The model's vocabulary as llguidance sees it, from a ``tokenizers`` JSON (tokenizer.json); about a
    second for a 50k vocabulary, so build it once. Masks are ``vocab_size`` wide (the logits' width) and
    allow the EOS ids once the constrained text is complete."""
    eos = list(eos_token_ids)
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos or None)


def _short(message: str) -> str:
    """llguidance's messages can list a whole vocabulary's special tokens: keep their head."""
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + " ..."


class SpecCache(Generic[T]):
    """What was made from each distinct spec (``spec_key``), at most ``capacity`` of them, least recently
    used dropped first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[tuple[str, str], T] = OrderedDict()

    def get(self, key: tuple[str, str], make: Callable[[], T]) -> T:
        value = self._items.get(key)
        if value is None:
            value = self._items[key] = make()
            if len(self._items) > self.capacity:
                self._items.popitem(last=False)
        else:
            self._items.move_to_end(key)
        return value
