"""Repetition, frequency and presence penalties, applied to raw logits for a batch of penalised requests."""

from __future__ import annotations

import torch

from services.worker.sampling.request_sampling import PENDING_FLUSH_LIMIT, RequestSampling, device_tensor


def gather_penalty_state(
    requests: list[RequestSampling], vocab_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack the requests' penalty state: (output_counts [P, vocab] int32, prompt_mask [P, vocab] bool).

    Tokens appended since the last step are added here in one batched scatter. A request whose list
    of such tokens grew past PENDING_FLUSH_LIMIT gets its device counts rewritten and the list cleared.
    """
    for r in requests:
        r.materialize(vocab_size, device)
    counts = torch.cat([r.output_counts for r in requests])
    prompt_mask = torch.cat([r.prompt_mask for r in requests])
    rows: list[int] = []
    tokens: list[int] = []
    for row, r in enumerate(requests):
        pending = [t for t in r.pending_token_ids if 0 <= t < vocab_size]
        rows.extend([row] * len(pending))
        tokens.extend(pending)
    if tokens:
        index = device_tensor([rows, tokens], torch.long, device)
        ones = torch.ones(len(tokens), dtype=torch.int32, device=device)
        counts.index_put_((index[0], index[1]), ones, accumulate=True)
    for row, r in enumerate(requests):
        if len(r.pending_token_ids) >= PENDING_FLUSH_LIMIT:
            r.output_counts = counts[row : row + 1].clone()
            r.pending_token_ids.clear()
    return counts, prompt_mask


def penalty_params(requests: list[RequestSampling], device: torch.device) -> torch.Tensor:
    """[P, 3] float32: repetition, frequency, presence penalty per row."""
    values = [[r.repetition_penalty, r.frequency_penalty, r.presence_penalty] for r in requests]
    return device_tensor(values, torch.float32, device)


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    params: torch.Tensor,
    any_repetition: bool = True,
) -> torch.Tensor:
    """Penalise logits [P, vocab] float32 and return them (``any_repetition=False`` skips the
    repetition step when every row's repetition penalty is 1).

    Repetition (CTRL/HF): a token seen in the prompt or the output has a positive logit divided by
    the penalty, a negative one multiplied. Then OpenAI's: logit -= frequency * count + presence * (count > 0),
    with counts over output tokens only.
    """
    repetition, frequency, presence = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    generated = counts > 0
    if any_repetition:
        seen = prompt_mask | generated
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(seen, penalised, logits)
    return logits - (frequency * counts + presence * generated)
