"""The worker's speculative step: propose for the rows the plan gave lookahead slots, verify after the forward.

``propose`` appends each eligible row's proposals to its tokens and schedules them with its decode token, so
the runner computes them in the same pass as a short chunked-prefill row (causal over the paged KV).
``verify`` turns the logits of those rows into the emitted tokens and rolls each row back to them: the
proposals leave the row's tokens, its computed count keeps only the accepted ones (the K/V written for the
rejected ones lie past it and are overwritten later).

Rows speculate only where the sampler's per-token state is the whole story: no penalties, logprobs,
structured output or min_tokens ban (those depend on the tokens before each position). A request whose
recent proposals were mostly rejected stops proposing for a while (``Backoff``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.common.speculative import SpeculativeConfig
from services.worker.request_state import RequestState
from services.worker.sampling.sampler import Sampler
from services.worker.spec_decode.ngram import NgramProposer
from services.worker.spec_decode.verify import accept_greedy, rejection_sample

# Backoff: over the last WINDOW proposed tokens (at least), an acceptance rate below MIN_ACCEPTANCE pauses the
# request's proposals for PAUSE_STEPS decode steps; then it tries again with a fresh window.
WINDOW = 16
MIN_ACCEPTANCE = 0.2
PAUSE_STEPS = 32


@dataclass(slots=True)
class Backoff:
    num_proposed: int = 0
    num_accepted: int = 0
    pause: int = 0

    def allows(self) -> bool:
        if self.pause:
            self.pause -= 1
            return False
        return True

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        if self.num_proposed >= WINDOW:
            if self.num_accepted < MIN_ACCEPTANCE * self.num_proposed:
                self.pause = PAUSE_STEPS
            self.num_proposed = self.num_accepted = 0


@dataclass(slots=True)
class SpecStats:
    """Counters with vLLM's meaning: drafts (verify steps with proposals), proposed and accepted tokens, and
    accepted tokens by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, on_verified=None, draft_proposer=None):
        """``on_verified(num_draft_tokens, num_accepted_tokens)`` is called per verified row (metrics);
        ``draft_proposer``: the draft model's proposer (method draft_model)."""
        if config.method == "draft_model" and draft_proposer is None:
            raise ValueError("method draft_model needs the draft model's proposer")
        self.config = config
        self.proposer = draft_proposer or NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.on_verified = on_verified

    def propose(self, requests: list[RequestState]) -> list[RequestState]:
        """Extend eligible rows with their proposals; returns the rows that got some."""
        wanted = {}
        for r in requests:
            r.num_drafts = 0
            k = r.num_lookahead_tokens
            if not k or not _eligible(r):
                continue
            if r.spec_backoff is None:
                r.spec_backoff = Backoff()
            if r.spec_backoff.allows():
                wanted[id(r)] = k
        proposals = self.proposer.propose(requests, wanted)  # the draft model also catches up on every row
        rows = []
        for r in requests:
            drafts = proposals.get(id(r))
            if drafts:
                r.token_ids.extend(drafts)
                r.num_scheduled_tokens += len(drafts)
                r.num_drafts = len(drafts)
                rows.append(r)
        return rows

    @torch.inference_mode()
    def verify(self, logits: torch.Tensor, rows: list[RequestState], sampler: Sampler) -> list[list[int]]:
        """logits: [sum(num_drafts + 1), vocab], each row's positions in order -> each row's emitted tokens.
        Rolls each row back to what it emitted (the caller has already counted its scheduled tokens computed)."""
        emitted = []
        start = 0
        for r in rows:
            d = r.num_drafts
            drafts = r.token_ids[-d:]
            row_logits = logits[start : start + d + 1]
            start += d + 1
            if r.sampling.greedy:
                tokens = accept_greedy(row_logits[:, : sampler.vocab_size].argmax(dim=-1).tolist(), drafts)
            else:
                probs = sampler.probs(row_logits, [r.sampling] * (d + 1))
                tokens = rejection_sample(probs, drafts, lambda j, s=r.sampling: sampler.generator(s, j))
            num_accepted = len(tokens) - 1
            del r.token_ids[-d:]
            r.num_computed_tokens -= d - num_accepted
            r.draft_num_computed = min(r.draft_num_computed, r.num_computed_tokens)
            r.num_drafts = 0
            r.spec_backoff.record(d, num_accepted)
            self._record(d, num_accepted)
            emitted.append(tokens)
        return emitted

    def _record(self, num_drafts: int, num_accepted: int) -> None:
        stats = self.stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1
        if self.on_verified is not None:
            self.on_verified(num_drafts, num_accepted)


def _eligible(r: RequestState) -> bool:
    s = r.sampling
    return (
        r.pooling is None
        and r.num_scheduled_tokens == 1
        and r.samples_this_step
        and not s.penalised
        and s.num_logprobs == 0
        and s.constraint is None
        and s.num_output_tokens >= s.min_tokens
    )
