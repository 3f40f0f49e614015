"""Draft-model proposals: a smaller model with the target's tokenizer proposes greedily, k tokens per row.

The draft runs beside the target with its own paged KV cache, addressed by the target's block tables (the
same block ids, its own smaller tensors), so the scheduler's allocation covers both. Its K/V are kept in
step with the target's: every step it first computes the tokens the target computes in that step (and any
it lags behind by, ``draft_num_computed``), which also gives the first proposal of each speculating row;
then one decode pass per further proposal. A proposal is the draft's argmax: a deterministic proposer,
so verification treats it as one-hot (``verify``), exact for greedy and random requests alike.

After verification a row's draft K/V are valid up to the accepted tokens, except the last proposal's,
which was never fed back: when every proposal is accepted the draft lags one token, computed next step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.worker.model_runner import ModelRunner
from services.worker.request_state import RequestState


@dataclass(slots=True)
class _DraftRow:
    """A request as the draft's pass sees it (the fields ``ModelRunner.prepare`` reads)."""

    state: RequestState
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int
    prompt_logprobs: int = -1
    pooling: None = None
    num_drafts: int = 0
    # A text draft reads image placeholders as their tokens: its proposals are only worse, the target checks them.
    mm_inputs: tuple = ()
    lora: None = None  # the draft runs the base weights: adapters are the target's

    @property
    def samples_this_step(self) -> bool:
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)


class DraftModelProposer:
    def __init__(self, runner: ModelRunner):
        """``runner``: the draft model over its own KV cache of the target's block count and size."""
        self.runner = runner
        self.vocab_size = runner.sampler.vocab_size

    def propose(self, requests: list[RequestState], wanted: dict[int, int]) -> dict[int, list[int]]:
        """Catch the draft up on every row's tokens of this step; ``wanted``: id(row) -> proposals for the rows
        that speculate. Returns id(row) -> proposals."""
        rows = []
        for r in requests:
            if r.pooling is not None:
                continue
            if r.draft_num_computed < 0:  # a new request: its prefix hit has the draft's K/V too
                r.draft_num_computed = r.num_computed_tokens
            end = r.num_computed_tokens + r.num_scheduled_tokens
            if end > r.draft_num_computed:
                rows.append(_DraftRow(r, r.token_ids, r.block_ids, r.draft_num_computed, end - r.draft_num_computed))
        proposals: dict[int, list[int]] = {}
        if not rows:
            return proposals
        tokens = self._run(rows)
        for row in rows:
            row.state.draft_num_computed = row.num_computed_tokens + row.num_scheduled_tokens
        speculating = []
        for row in rows:
            k = wanted.get(id(row.state), 0)
            if k and row.samples_this_step:
                proposals[id(row.state)] = [tokens[id(row)]]
                if k > 1:
                    speculating.append((row, k))
        # One decode pass per further proposal, over the rows that want more: the last proposal is fed back.
        step = 1
        while speculating:
            views = []
            for row, _ in speculating:
                drafts = proposals[id(row.state)]
                known = row.token_ids + drafts  # a copy: the request's own tokens are not touched
                position = len(known) - 1
                views.append(_DraftRow(row.state, known, row.block_ids, position, 1))
            tokens = self._run(views)
            for view in views:
                proposals[id(view.state)].append(tokens[id(view)])
                view.state.draft_num_computed = view.num_computed_tokens + 1
            step += 1
            speculating = [(row, k) for row, k in speculating if k > step]
        return proposals

    @torch.inference_mode()
    def _run(self, rows: list[_DraftRow]) -> dict[int, int]:
        """One pass of the draft over ``rows``; id(row) -> argmax at its last position, for rows that end there."""
        inputs = self.runner.prepare(rows)
        logits, _ = self.runner.forward(inputs)
        argmax = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        return {id(row): token for row, token in zip(inputs.sampling_requests, argmax, strict=True)}
