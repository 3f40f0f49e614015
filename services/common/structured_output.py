"""SamplingParams.structured_output as llguidance grammars: the one translation the frontend (which checks
a spec) and the worker (which compiles and applies it) share, so both read a spec the same way.

llguidance (Rust, no torch) compiles JSON schemas, regexes, choices and Lark/GBNF grammars against the
model's vocabulary and computes a token mask per step in microseconds. The scheduler never imports this.

What one spec may cost is bounded by ``parser_limits``, the same on both sides: the frontend refuses a spec
whose lexer does not build within ``LEXER_FUEL`` (``build_error``), and the worker's matchers run under the
same limits, so a spec that got past no frontend still costs its own request (its matcher fails: EOS only),
never seconds of everyone's step.
"""

from __future__ import annotations

import json
import threading
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
# llguidance's fuel for building a matcher's lexer (regex derivatives; about 50,000 a millisecond): the cost
# lies in large counted repetitions (``a{100000}``, ``(a{1000}){1000}``, a schema ``pattern`` or length bound
# written as one), which the library's default of 1,000,000 lets take most of a second on the step that first
# masks them, then tens of milliseconds on every later step. Schemas with dozens of properties, formats and
# enums of a thousand strings need well under this; per-step work keeps llguidance's own limits.
LEXER_FUEL = 100_000
PROBE_TOKENS = 8  # steps of a spec's check at the frontend (``build_error``)
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


def parser_limits() -> llguidance.LLParserLimits:
    """The resource limits of every matcher, on the frontend and the worker alike; errors name no parser state."""
    return llguidance.LLParserLimits(initial_lexer_fuel=LEXER_FUEL, verbose_errors=False)


def new_matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    """A matcher under ``parser_limits``; one that cannot build is in its error state (``get_error``)."""
    return llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())


def grammar_error(grammar: str, tokenizer: llguidance.LLTokenizer | None) -> str:
    """'' when ``grammar`` compiles (against ``tokenizer``'s vocabulary when given), else the problem."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=parser_limits())
    return _short(messages[0]) if is_error else ""


def build_error(grammar: str, tokenizer: llguidance.LLTokenizer, eos_token_ids: Sequence[int]) -> str:
    """'' when a matcher of ``grammar`` builds its lexer within ``parser_limits`` along a first few tokens,
    else llguidance's reason.

    The lexer is built lazily, as masks and tokens reach its parts: this walks PROBE_TOKENS steps (mask, then
    the lowest allowed token), as a worker's first steps would. That reaches a regex's or a string pattern's
    cost, and a schema's when its first values are near the start; what lies deeper is bounded on the worker
    by the same limits. Costs up to ``LEXER_FUEL`` (tens of milliseconds); llguidance drops the GIL."""
    matcher = new_matcher(tokenizer, grammar)
    eos_bits = sum(1 << eos for eos in set(eos_token_ids))
    for _ in range(PROBE_TOKENS):
        allowed = int.from_bytes(matcher.compute_bitmask(), "little") & ~eos_bits  # bit i: token i may come next
        if not allowed or matcher.is_error():
            break
        matcher.consume_token((allowed & -allowed).bit_length() - 1)
        if matcher.is_error() or matcher.is_stopped():
            break
    return _short(matcher.get_error().split("\n", 1)[0]) if matcher.is_error() else ""


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
        # The frontend checks specs in threads; ``make`` runs outside the lock (two threads may both make a
        # value for a new key: the same value, the last one kept).
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str], make: Callable[[], T]) -> T:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
                return value
        value = make()
        with self._lock:
            self._items[key] = value
            if len(self._items) > self.capacity:
                self._items.popitem(last=False)
        return value
