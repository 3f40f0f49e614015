"""Whether a structured-output spec compiles against the served vocabulary, answered once per distinct spec.

The worker compiles the same grammar (``services.common.structured_output``) against the same
tokenizer.json, so a spec accepted here compiles there; one rejected here is INVALID_ARGUMENT.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgrid.v1 import common_pb2
from services.common.structured_output import (
    SpecCache,
    SpecError,
    build_tokenizer,
    grammar_error,
    grammar_for,
    spec_key,
)

MAX_CACHED = 256


class GrammarChecker:
    def __init__(self, tokenizer=None, unavailable: str = ""):
        """``tokenizer``: llguidance's view of the vocabulary (None checks grammars without one, e.g. before
        a worker's handshake); ``unavailable``: why this model cannot serve structured outputs at all."""
        self.tokenizer = tokenizer
        self.unavailable = unavailable
        self._problems: SpecCache[tuple[str, str]] = SpecCache(MAX_CACHED)

    @classmethod
    def build(cls, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarChecker:
        """About a second for a 50k vocabulary: call it off the event loop."""
        try:
            return cls(build_tokenizer(tokenizer_json, vocab_size, eos_token_ids))
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
        return (field, f"does not compile: {message}") if message else ("", "")
