"""Rejection sampling keeps the target's distribution: the first emitted token over many seeds, chi-square.

The target distribution is a tiny random Llama's next-token distribution at temperature 0.8 with top-k 20; the
proposal is its most likely token, so acceptance and the residual both matter. A sampler that draws from
the target instead of the residual after a rejection (over-weighting the proposal) must fail the same test.
"""

from __future__ import annotations

import torch

from services.worker.spec_decode.verify import accept_greedy, rejection_sample

NUM_SEEDS = 6000
# A correct sampler fails with this probability; a biased one passes with far less.
P_VALUE = 1e-3


def target_distribution(tmp_path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    from tests.worker.tiny import save_tiny_model

    save_tiny_model(str(tmp_path), max_position_embeddings=64)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([[5, 9, 12, 7, 30, 2]])).logits[0, -2:] / 0.8  # [2, vocab]
    top = logits.topk(20, dim=-1)
    masked = torch.full_like(logits, float("-inf")).scatter_(1, top.indices, top.values)
    return masked.softmax(dim=-1)  # [2, vocab]: positions 0 and 1 (the bonus)


def first_tokens(probs: torch.Tensor, draft: int, sample) -> torch.Tensor:
    counts = torch.zeros(probs.shape[-1])
    gen = torch.Generator()
    for seed in range(NUM_SEEDS):
        gen.manual_seed(1000 + seed)
        counts[sample(probs, [draft], lambda j, g=gen: g)[0]] += 1
    return counts


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    big = expected >= 5  # cells too small for the test are pooled into one
    observed = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    expected = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    stat = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(observed) - 1))
    return float(torch.special.gammaincc(df / 2, stat / 2))


def biased_rejection_sample(probs, drafts, generator):
    """Draws from the target itself after a rejection: the proposal gets p + (1 - p) p."""
    g = generator(0)
    if torch.rand((), generator=g).item() < float(probs[0, drafts[0]]):
        return [drafts[0]]
    return [int(torch.multinomial(probs[0], 1, generator=g))]


def test_first_token_matches_the_target_and_a_biased_sampler_fails(tmp_path):
    probs = target_distribution(tmp_path)
    draft = int(probs[0].argmax())
    assert 0.05 < float(probs[0, draft]) < 0.9  # rejections and acceptances both happen
    counts = first_tokens(probs, draft, rejection_sample)
    assert chi_square_p_value(counts, probs[0]) > P_VALUE
    biased = first_tokens(probs, draft, biased_rejection_sample)
    assert chi_square_p_value(biased, probs[0]) < P_VALUE


def test_an_unlikely_proposal_is_rejected_and_the_first_token_still_matches(tmp_path):
    probs = target_distribution(tmp_path)
    draft = int(probs[0].argmin())  # outside the top-k: probability 0, always rejected
    counts = first_tokens(probs, draft, rejection_sample)
    assert counts[draft] == 0
    assert chi_square_p_value(counts, probs[0]) > P_VALUE


def test_seeded_generators_reproduce_the_same_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.2, 0.6]])

    def run(seed):
        gens = [torch.Generator().manual_seed(seed * 10 + j) for j in range(3)]
        return rejection_sample(probs, [1, 2], lambda j: gens[j])

    assert all(run(s) == run(s) for s in range(50))
    assert len({tuple(run(s)) for s in range(50)}) > 1


def test_greedy_acceptance_stops_at_the_first_mismatch_and_adds_the_target_token():
    assert accept_greedy([4, 5, 6], [4, 5]) == [4, 5, 6]  # all accepted, plus the bonus
    assert accept_greedy([4, 9, 6], [4, 5]) == [4, 9]  # the target's token replaces the first mismatch
    assert accept_greedy([7, 5, 6], [4, 5]) == [7]
