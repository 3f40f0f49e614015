"""Verification of proposed tokens against the target model's distributions at the same positions.

Greedy: accept while the target's argmax equals the proposal, then the target's own token (the first
mismatch, or the bonus token after all proposals): exactly the tokens greedy decoding would give.

Random: standard speculative rejection sampling (Leviathan et al.; Chen et al.). Proposal x at
position j, drawn from q_j, is accepted with probability min(1, p_j(x) / q_j(x)); at the first rejection
a token is drawn from the residual norm(max(0, p_j - q_j)) and the rest is dropped; if all are accepted a
bonus token is drawn from p_{d}. Each emitted token is then distributed exactly as p (the target's
processed distribution). For n-gram proposals q_j is one-hot on x: accept with probability p_j(x), and the
residual is p_j without x.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def accept_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """``target_ids``: the target's argmax at each of the ``len(drafts) + 1`` positions -> the emitted tokens."""
    out = []
    for target, draft in zip(target_ids, drafts, strict=False):
        out.append(target)
        if target != draft:
            return out
    out.append(target_ids[len(drafts)])
    return out


def rejection_sample(
    probs: torch.Tensor,
    drafts: list[int],
    generator: Callable[[int], torch.Generator],
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """probs: [d + 1, vocab] the target's processed distributions; draft_probs: [d, vocab] the proposer's (None:
    one-hot on each proposal); ``generator(j)`` gives the generator for position j. -> the emitted tokens."""
    out = []
    for j, draft in enumerate(drafts):
        g = generator(j)
        p = probs[j]
        q_draft = 1.0 if draft_probs is None else float(draft_probs[j, draft])
        u = torch.rand((), generator=g, device=p.device).item()
        if u * q_draft < float(p[draft]):
            out.append(draft)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - draft_probs[j]).clamp_min_(0.0)
        if not float(residual.sum()) > 0.0:
            residual = p  # rounding left nothing: p is one-hot on the draft, which a rejection cannot be
        out.append(int(torch.multinomial(residual, 1, generator=g)))
        return out
    out.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator(len(drafts)))))
    return out
