"""Lookahead slots for speculative decoding: how many proposed tokens a decode row may carry.

A decode row planned with ``k`` lookahead tokens holds blocks for its scheduled token and ``k`` more and
costs ``1 + k`` of the step's token budget. The worker proposes up to ``k`` tokens, computes them with
the scheduled one in one pass and answers the accepted proposals plus one token it sampled (1 to
``1 + k`` tokens). The scheduler then counts the accepted proposals as computed: their K/V were written
by the pass; the K/V written for rejected proposals lie past ``num_computed_tokens`` and are overwritten
by later steps. Blocks allocated for them stay in the table (it is append-only): the sequence grows
into them.

Plans are made one at a time while a speculative step is in flight (no async scheduling, no plans of
several steps): the next plan must know how many tokens the last one produced.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.request import Request


@dataclass(slots=True)
class Lookahead:
    num_speculative_tokens: int
    # More running requests than this: no lookahead in the step (0: no limit).
    disable_by_batch_size: int = 0

    def enabled(self, num_running: int) -> bool:
        return not self.disable_by_batch_size or num_running <= self.disable_by_batch_size

    def count(self, request: Request, max_seq_len: int) -> int:
        """Lookahead tokens for ``request``'s decode: never more outputs than max_tokens nor a sequence past
        ``max_seq_len`` (the K/V of a rejected proposal is written too, so its slot must exist); none for a
        request with a token in flight or under structured output (its grammar is advanced per token)."""
        if request.num_output_placeholders or request.stop.structured:
            return 0
        num_tokens = request.num_tokens
        if request.num_computed_tokens != num_tokens - 1:
            return 0  # not a decode: a prompt chunk still to compute
        left_outputs = request.stop.max_tokens - request.num_output_tokens - 1
        left_positions = max_seq_len - num_tokens
        return max(0, min(self.num_speculative_tokens, left_outputs, left_positions))
