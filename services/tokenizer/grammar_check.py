"""Whether a structured-output spec compiles against the served vocabulary, and builds within the budget every
matcher runs under (``structured_output.parser_limits``), answered once per distinct spec.

The worker compiles the same grammar (``services.common.structured_output``) against the same
tokenizer.json under the same limits, so a spec accepted here compiles and builds there; one rejected here is
INVALID_ARGUMENT. A check costs up to the lexer fuel budget (tens of milliseconds, the GIL dropped): the front
door runs it off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgrid.v1 import common_pb2
from services.common.structured_output import (
    LEXER_FUEL,
    SpecCache,
    SpecError,
    build_error,
    build_tokenizer,
    grammar_error,
    grammar_for,
    spec_key,
)

MAX_CACHED = 256


class GrammarChecker:
    def __init__(self, tokenizer=None, unavailable: str = "", eos_token_ids: Sequence[int] = ()):
        """``tokenizer``: llguidance's view of the vocabulary (None checks grammars without one, e.g. before
        a worker's handshake: syntax only, no budget); ``unavailable``: why this model cannot serve structured
        outputs at all; ``eos_token_ids``: the tokens that end a constrained output."""
        self.tokenizer = tokenizer
        self.unavailable = unavailable
        self.eos_token_ids = list(eos_token_ids)
        self._problems: SpecCache[tuple[str, str]] = SpecCache(MAX_CACHED)

    @classmethod
    def build(cls, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarChecker:
        """About a second for a 50k vocabulary: call it off the event loop."""
        try:
            return cls(build_tokenizer(tokenizer_json, vocab_size, eos_token_ids), eos_token_ids=eos_token_ids)
        except ValueError as exc:  # e.g. a word-level vocabulary without a decoder
            return cls(unavailable=f"the model's tokenizer is not supported by llguidance: {exc}")

    def problem(self, sampling: common_pb2.SamplingParams) -> tuple[str, str]:
        """(field, message) of what is wrong with the request's constraint, or ("", "")."""
        key = spec_key(sampling)
        if key is None:
            return "", ""
        if self.unavailable:
            return f"sampling.{key[0]}", f"structured outputs are unavailable: {self.unavailable}"
        return self._problems.get(key, lambda: self._check(sampling))

    def _check(self, sampling: common_pb2.SamplingParams) -> tuple[str, str]:
        field = f"sampling.{sampling.WhichOneof('structured_output')}"
        try:
            grammar = grammar_for(sampling)
        except SpecError as exc:
            return exc.field, str(exc)
        message = grammar_error(grammar, self.tokenizer)
        if message:
            return field, f"does not compile: {message}"
        if self.tokenizer is None:
            return "", ""
        message = build_error(grammar, self.tokenizer, self.eos_token_ids)
        if message:
            return field, (
                f"too costly to build: {message} (structured outputs get {LEXER_FUEL} units of llguidance's lexer"
                " fuel; large counted repetitions such as a{100000}, or length bounds written as one, exceed it)"
            )
        return "", ""
