"""Min-p, top-k and top-p cuts on temperature-scaled logits [R, vocab]: dropped tokens become -inf."""

from __future__ import annotations

import torch

# Top-p first looks for the nucleus among this many best tokens (a partial top-k is far cheaper than
# sorting the vocabulary, and topk's cost grows with k; benchmarks/sampling_bench.py times both cases:
# logits at scale 6 keep the nucleus among the candidates, at scale 1 they force the full sort);
# only rows whose candidates hold less than top_p of the mass are sorted in full.
TOP_P_CANDIDATES = 256


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p); min_p [R], 0 is off."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> None:
    """Keep the top_k [R] largest logits per row (ties with the k-th are kept); top_k >= vocab is off.
    max_k: the largest top_k below vocab."""
    vocab = logits.shape[-1]
    top_values = logits.topk(max_k, dim=-1).values  # [R, max_k], best first
    kth = top_values.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth.masked_fill_((top_k >= vocab).unsqueeze(1), float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int) -> torch.Tensor:
    """Top-k, then top-p over the renormalised survivors: keep the smallest best-first set whose
    probability reaches top_p, i.e. token i survives while the mass strictly before it is < top_p.

    top_k [R] int64 (vocab: off), top_p [R] float32 (> 1: off), max_k: the largest top_k below vocab
    (0 if none). Returns the filtered logits as a new tensor.
    """
    vocab = logits.shape[-1]
    num_candidates = max(TOP_P_CANDIDATES, max_k)
    if num_candidates >= vocab:
        values, ids = logits.sort(dim=-1, descending=True)
        return _keep_nucleus(logits, values, ids, top_k, top_p)[0]
    values, ids = logits.topk(num_candidates, dim=-1)  # [R, C], best first
    filtered, short = _keep_nucleus(logits, values, ids, top_k, top_p)
    short_rows = short.nonzero().squeeze(1)
    if short_rows.numel():
        # These rows' nuclei reach past the candidates: sort just them in full.
        rows = logits[short_rows]
        values, ids = rows.sort(dim=-1, descending=True)
        filtered[short_rows] = _keep_nucleus(rows, values, ids, top_k[short_rows], top_p[short_rows])[0]
    return filtered


def _keep_nucleus(
    logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """values/ids [R, C]: each row's C best logits, best first (C = vocab after a full sort).

    Every top_k cut fits inside the C candidates. A row without a top-k cut normalises over the whole
    vocabulary; if its candidates hold less than top_p of the mass its nucleus is not all there.
    Returns (filtered logits [R, vocab], short [R] bool: rows whose nucleus is not all in the candidates).
    """
    vocab, num_candidates = logits.shape[-1], values.shape[-1]
    positions = torch.arange(num_candidates, device=logits.device)
    values = values.masked_fill(positions.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    uncut = (top_k >= vocab).unsqueeze(1)  # [R, 1]
    log_norm = torch.where(
        uncut, logits.logsumexp(dim=-1, keepdim=True), values.logsumexp(dim=-1, keepdim=True)
    )  # [R, 1]; the same for every row after a full sort
    probs = (values - log_norm).exp()
    cumulative = probs.cumsum(dim=-1)
    short = uncut.squeeze(1) & (top_p <= 1.0) & (cumulative[:, -1] < top_p)
    # The best token always survives: the mass before it is 0 and top_p > 0.
    values.masked_fill_(cumulative - probs >= top_p.unsqueeze(1), float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter_(1, ids, values)
    # Rows with neither cut keep every logit (a partial candidate set would drop their tail).
    untouched = uncut & (top_p > 1.0).unsqueeze(1)
    return torch.where(untouched, logits, filtered), short
