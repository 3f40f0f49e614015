"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-probability of each prompt token given the ones before.

Prompt token ``p`` (``p >= 1``) is scored by the logits of position ``p - 1``, so a step that computes positions
``[start, end)`` of a request can score tokens ``start + 1 .. end`` that lie in the prompt; a chunked prefill
scores its prompt chunk by chunk. Only the rows of requests that asked go through the LM head at full vocabulary
width, in float32, a bounded number of rows at a time. A request resumed after a preemption skips the tokens the
scheduler already has (``NewRequest.num_prompt_logprobs_done``); the scheduler drops any it gets twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgrid.v1 import common_pb2, worker_pb2
from services.worker.request_state import RequestState

# Rows put through the LM head at once: bounds the float32 [rows, vocab] buffers of a long prefill chunk.
MAX_ROWS_PER_PASS = 128


@dataclass(slots=True)
class PromptRows:
    """The flat-batch rows of one step whose logits score prompt tokens, and what each scores."""

    rows: list[int] = field(default_factory=list)  # row of the flat batch (the position before the token)
    targets: list[int] = field(default_factory=list)  # the prompt token that row scores
    num_top: list[int] = field(default_factory=list)  # alternatives to return for that row
    # (request, first prompt position scored, count) in row order
    spans: list[tuple[RequestState, int, int]] = field(default_factory=list)

    def add(self, request: RequestState, first_row: int, start: int, end: int) -> None:
        """``request`` computes positions ``[start, end)`` from flat-batch row ``first_row`` on this step."""
        k = request.prompt_logprobs
        if k < 0:
            return
        first = max(start + 1, request.prompt_logprobs_next)  # the first prompt token to score
        last = min(end, request.num_prompt_tokens - 1)  # the last one: scored by position end - 1
        if first > last:
            return
        self.rows += range(first_row + first - 1 - start, first_row + last - start)
        self.targets += request.token_ids[first : last + 1]
        self.num_top += [k] * (last + 1 - first)
        self.spans.append((request, first, last + 1 - first))

    def __bool__(self) -> bool:
        return bool(self.rows)

    @torch.inference_mode()
    def compute(self, compute_logits, hidden: torch.Tensor) -> None:  # hidden [T, E]
        """Score the rows with ``compute_logits`` ([R, E] -> [R, vocab]) and hand each request its entries."""
        entries: list[common_pb2.PromptLogprob] = []
        device = hidden.device
        for lo in range(0, len(self.rows), MAX_ROWS_PER_PASS):
            hi = lo + MAX_ROWS_PER_PASS
            rows = torch.tensor(self.rows[lo:hi], dtype=torch.int64, device=device)
            targets = torch.tensor(self.targets[lo:hi], dtype=torch.int64, device=device)
            entries += _score(compute_logits(hidden[rows]), targets, self.num_top[lo:hi])
        i = 0
        for request, first, count in self.spans:
            request.prompt_logprobs_next = first + count
            request.prompt_logprobs_out.append(
                worker_pb2.PromptLogprobs(request_id=request.request_id, start=first, logprobs=entries[i : i + count])
            )
            i += count


def _score(logits: torch.Tensor, targets: torch.Tensor, num_top: list[int]) -> list[common_pb2.PromptLogprob]:
    """logits [R, vocab], targets [R] -> one entry per row: the target's logprob and rank, the row's top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    target_logprobs = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1  # [R]
    max_top = min(max(num_top), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(max_top, dim=-1)  # [R, max_top]
    rows = zip(
        targets.tolist(),
        target_logprobs.squeeze(1).tolist(),
        ranks.tolist(),
        num_top,
        top_ids.tolist(),
        top_values.tolist(),
        strict=True,
    )
    out = []
    for token_id, logprob, rank, k, ids, values in rows:
        top = [common_pb2.TopLogprob(token_id=t, logprob=v) for t, v in zip(ids[:k], values[:k], strict=True)]
        out.append(common_pb2.PromptLogprob(token_id=token_id, logprob=logprob, rank=rank, top=top))
    return out


def take(requests: list[RequestState]) -> list[worker_pb2.PromptLogprobs]:
    """The prompt logprobs the step computed for ``requests``, handed over once."""
    out = []
    for request in requests:
        if request.prompt_logprobs_out:
            out += request.prompt_logprobs_out
            request.prompt_logprobs_out = []
    return out
