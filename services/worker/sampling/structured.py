"""Structured outputs where the sampler runs: each distinct spec is compiled once, each request holds a
matcher advanced by every token sampled for it, and the sampler masks the logits of constrained rows.

A matcher's state is a function of the request's output tokens alone: a request resumed after preemption
rebuilds it from the tokens the NewRequest carries, so its masks (and with them greedy and seeded outputs)
are the same as if it had never left. Once the text is complete the mask allows only EOS, and the EOS
sampled next ends the request at the scheduler with finish reason "stop". A matcher that fails (a token
outside its mask: only possible if every allowed token was also banned; or a spec past the limits every matcher
runs under, ``structured_output.parser_limits``, which the frontend refuses before it gets here) also allows
only EOS: a costly spec ends its own request instead of slowing the step of every request in the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import llguidance
import torch

from kvgrid.v1 import common_pb2
from services.common.structured_output import (
    SpecCache,
    SpecError,
    build_tokenizer,
    grammar_for,
    new_matcher,
    spec_key,
)

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 128
_BITS = torch.arange(32, dtype=torch.int32)  # bit j of a mask word is token 32 * word + j


class TokenConstraint:
    """One request's matcher: the mask for its next token, advanced by each token it samples."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id) and self.matcher.is_error():
            log.warning("structured output: %s; only EOS is allowed from here", self.matcher.get_error()[:200])


class GrammarCache:
    """Compiles each distinct spec once (LRU of compiled matchers); a request gets a copy of the compiled one.

    Built from values (the tokenizer's JSON, the logits width, the EOS ids); llguidance's tokenizer is made
    at the first constrained request, so a worker that never sees one never pays for it."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self._tokenizer_json = tokenizer_json
        self._eos_token_ids = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: SpecCache[llguidance.LLMatcher] = SpecCache(MAX_CACHED_GRAMMARS)
        self.num_compiled = 0  # grammars compiled so far (cache misses)

    def constraint(self, params: common_pb2.SamplingParams, output_token_ids: list[int]) -> TokenConstraint | None:
        """The request's matcher, advanced over the outputs it already has (a resumed request); None when
        the request has no constraint."""
        key = spec_key(params)
        if key is None:
            return None
        compiled = self._compiled.get(key, lambda: self._compile(params))
        constraint = TokenConstraint(compiled.deep_copy())
        for token_id in output_token_ids:
            constraint.advance(token_id)
        return constraint

    def _compile(self, params: common_pb2.SamplingParams) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            self._tokenizer = build_tokenizer(self._tokenizer_json, self.vocab_size, self._eos_token_ids)
        try:
            grammar = grammar_for(params)
        except SpecError as exc:  # the frontend rejects these; a matcher in error allows only EOS
            grammar = llguidance.LLMatcher.grammar_from_regex("")
            log.warning("structured output: %s: %s", exc.field, exc)
        matcher = new_matcher(self._tokenizer, grammar)
        if matcher.is_error():
            log.warning("structured output does not compile: %s", matcher.get_error()[:200])
        self.num_compiled += 1
        return matcher


def apply_token_masks(logits: torch.Tensor, rows: list[int], constraints: list[TokenConstraint]) -> None:
    """logits: [num_rows, vocab] float32, changed in place: in each of ``rows`` the tokens its constraint
    does not allow become -inf."""
    vocab = logits.shape[-1]
    num_words = (vocab + 31) // 32
    bitmask = torch.empty(len(rows), num_words, dtype=torch.int32)  # host memory: llguidance writes it
    for i, constraint in enumerate(constraints):
        row = bitmask[i]
        constraint.matcher.unsafe_compute_mask_ptr(row.data_ptr(), num_words * 4)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    bits = _BITS.to(logits.device)
    banned = ((bitmask.unsqueeze(-1) >> bits).bitwise_and_(1) == 0).view(len(rows), num_words * 32)  # [R, >= vocab]
    for i, row in enumerate(rows):  # in place on row views: no gather and scatter of whole rows
        logits[row].masked_fill_(banned[i, :vocab], float("-inf"))
