"""The batched sampler on random logits: greedy, min-p / top-k / top-p, sampled distributions, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvgrid.v1 import common_pb2
from services.worker.sampling import filters as sampling_filters
from services.worker.sampling.sampler import RequestSampling, Sampler

CPU = torch.device("cpu")


def params(**fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**fields)


def request(prompt: list[int] | None = None, outputs: list[int] | None = None, **fields) -> RequestSampling:
    return RequestSampling.create(params(**fields), prompt or [], outputs or [])


def logits_from_probs(probs: list[float], rows: int) -> torch.Tensor:
    """[rows, len(probs)] logits whose softmax is probs."""
    return torch.tensor(probs, dtype=torch.float32).log().expand(rows, -1).contiguous()


def sample_many(sampler: Sampler, logits: torch.Tensor, **fields) -> torch.Tensor:
    """One call with one unseeded request per row; the draws are independent."""
    out = sampler(logits, [request(**fields) for _ in range(logits.shape[0])])
    return torch.tensor(out.token_ids)


# --- greedy and the temperature limit ---


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = Sampler(100, CPU)(logits, [request() for _ in range(16)])
    assert out.token_ids == logits.float().argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 16


def test_padding_columns_past_vocab_are_ignored():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    logits[:, 32:] = 100.0
    sampler = Sampler(32, CPU)
    assert sampler(logits, [request() for _ in range(4)]).token_ids == logits[:, :32].argmax(-1).tolist()
    assert all(t < 32 for t in sampler(logits, [request(temperature=1.0) for _ in range(4)]).token_ids)


def test_greedy_rows_in_a_mixed_batch_take_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    reqs = [request(), request(temperature=1.0), request(logprobs=2), request(temperature=0.5, seed=3), request()]
    reqs.append(request(top_k=5))  # top_k without temperature is still greedy
    out = Sampler(50, CPU)(logits, reqs)
    argmax = logits.argmax(-1).tolist()
    for row in (0, 2, 4, 5):
        assert out.token_ids[row] == argmax[row]


def test_low_temperature_approaches_greedy():
    # Logit gaps of at least 0.1 at T = 1e-3 make every other token's probability below e^-100.
    base = torch.randperm(200, generator=torch.Generator().manual_seed(3)).float() * 0.1
    logits = base.expand(500, -1).contiguous()
    tokens = sample_many(Sampler(200, CPU, seed=0), logits, temperature=1e-3)
    assert (tokens == base.argmax()).all()
    # Below the greedy threshold the request is greedy outright.
    assert request(temperature=1e-7).greedy
    assert not request(temperature=1e-3).greedy


def test_top_k_one_is_greedy():
    logits = torch.randn(300, 64, generator=torch.Generator().manual_seed(4))
    tokens = sample_many(Sampler(64, CPU, seed=1), logits, temperature=1.5, top_k=1)
    assert tokens.tolist() == logits.argmax(-1).tolist()


# --- filters: every draw stays in the kept set, and the kept set is all reachable ---


def shuffled(probs: list[float], seed: int) -> tuple[list[float], list[int]]:
    """probs in a random column order, and the original index -> column map."""
    order = torch.randperm(len(probs), generator=torch.Generator().manual_seed(seed)).tolist()
    out = [0.0] * len(probs)
    for i, column in enumerate(order):
        out[column] = probs[i]
    return out, order


@pytest.mark.parametrize("candidates", [2, 4, 1024])  # 2: the nucleus is not among them, a full sort
def test_top_p_keeps_exactly_the_nucleus(candidates, monkeypatch):
    monkeypatch.setattr(sampling_filters, "TOP_P_CANDIDATES", candidates)
    # Best-first masses 0.4, 0.65, 0.8, ...: top_p 0.7 needs the three best tokens.
    probs, column = shuffled([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02], seed=5)
    tokens = sample_many(Sampler(7, CPU, seed=2), logits_from_probs(probs, 4000), temperature=1.0, top_p=0.7)
    nucleus = {column[0], column[1], column[2]}
    assert set(tokens.tolist()) == nucleus
    # The survivors are renormalised: 0.4 / 0.8 = 0.5 of the draws go to the best one.
    assert abs((tokens == column[0]).float().mean().item() - 0.5) < 0.03


def filter_with_candidates(monkeypatch, candidates, logits, top_k, top_p) -> tuple[torch.Tensor, list[tuple]]:
    """apply_top_k_top_p with a given candidate count; also the [rows, columns] of each nucleus pass."""
    monkeypatch.setattr(sampling_filters, "TOP_P_CANDIDATES", candidates)
    passes = []
    keep_nucleus = sampling_filters._keep_nucleus

    def spy(logits, values, *args):
        passes.append(tuple(values.shape))
        return keep_nucleus(logits, values, *args)

    monkeypatch.setattr(sampling_filters, "_keep_nucleus", spy)
    max_k = max((k for k in top_k.tolist() if k < logits.shape[-1]), default=0)
    return sampling_filters.apply_top_k_top_p(logits.clone(), top_k, top_p, max_k), passes


def test_top_p_over_candidates_equals_the_full_sort(monkeypatch):
    vocab = 300
    gen = torch.Generator().manual_seed(17)
    scales = torch.tensor([8.0, 6.0, 5.0, 8.0, 7.0, 6.0])  # peaked rows: the nuclei are small
    logits = torch.randn(6, vocab, generator=gen) * scales.unsqueeze(1)
    top_k = torch.tensor([vocab, vocab, 5, 40, vocab, 3])
    top_p = torch.tensor([0.9, 0.5, 0.8, 2.0, 2.0, 0.95])  # 2.0: off
    reference, passes = filter_with_candidates(monkeypatch, vocab, logits, top_k, top_p)
    assert passes == [(6, vocab)]  # candidates >= vocab: one full sort
    peaked, passes = filter_with_candidates(monkeypatch, 64, logits, top_k, top_p)
    assert passes == [(6, 64)]
    assert peaked.equal(reference)
    assert reference[4].equal(logits[4])  # neither cut: untouched
    assert (reference[5] > float("-inf")).sum() <= 3
    # Flat rows whose nuclei are wider than the candidates: only they are sorted in full.
    flat = torch.cat([logits[:3], torch.randn(1, vocab, generator=gen) * 0.1, logits[3:], torch.zeros(1, vocab)])
    flat_k = torch.cat([top_k[:3], torch.tensor([vocab]), top_k[3:], torch.tensor([vocab])])
    flat_p = torch.cat([top_p[:3], torch.tensor([0.9]), top_p[3:], torch.tensor([0.505])])
    reference, _ = filter_with_candidates(monkeypatch, vocab, flat, flat_k, flat_p)
    fallback, passes = filter_with_candidates(monkeypatch, 64, flat, flat_k, flat_p)
    assert passes == [(8, 64), (2, vocab)]
    assert fallback.equal(reference)
    assert (reference[3] > float("-inf")).sum() > 64
    assert (reference[7] > float("-inf")).sum() == 152  # uniform: mass before token i is i / 300


def test_top_p_boundary_includes_the_token_that_reaches_it():
    probs, column = shuffled([0.5, 0.3, 0.2], seed=6)
    tokens = sample_many(Sampler(3, CPU, seed=3), logits_from_probs(probs, 2000), temperature=1.0, top_p=0.75)
    assert set(tokens.tolist()) == {column[0], column[1]}


def test_top_k_keeps_the_k_best():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(7)) * 0.3
    tokens = sample_many(Sampler(64, CPU, seed=4), logits.expand(3000, -1).contiguous(), temperature=1.0, top_k=4)
    assert set(tokens.tolist()) == set(logits.topk(4).indices.tolist())


def test_min_p_drops_tokens_below_the_cut():
    # max prob 0.35, min_p 0.2: tokens below 0.07 go.
    probs, column = shuffled([0.35, 0.25, 0.2, 0.1, 0.05, 0.03, 0.02], seed=8)
    tokens = sample_many(Sampler(7, CPU, seed=5), logits_from_probs(probs, 4000), temperature=1.0, min_p=0.2)
    assert set(tokens.tolist()) == {column[i] for i in range(4)}


def test_filters_combine_per_row():
    probs, column = shuffled([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02], seed=9)
    kinds = [dict(top_k=2), dict(top_p=0.5), dict(min_p=0.3), dict()]
    draws = 300
    reqs = [request(temperature=1.0, **kind) for _ in range(draws) for kind in kinds]  # kinds interleaved
    out = Sampler(7, CPU, seed=6)(logits_from_probs(probs, len(reqs)), reqs)
    seen = [set(out.token_ids[i :: len(kinds)]) for i in range(len(kinds))]
    assert seen[0] == {column[0], column[1]}
    assert seen[1] == {column[0], column[1]}
    assert seen[2] == {column[0], column[1], column[2]}
    assert len(seen[3]) >= 6


def test_out_of_range_filters_are_off():
    logits = torch.randn(8, 10, generator=torch.Generator().manual_seed(10))
    sampler = Sampler(10, CPU, seed=7)
    # top_k beyond the vocabulary or -1, top_p above 1: plain sampling, and no crash.
    out = sampler(logits, [request(temperature=1.0, top_k=k) for k in (1000, -1, 0, 10)] * 2)
    assert all(0 <= t < 10 for t in out.token_ids)
    assert request(top_k=-1).top_k == 0 and request(top_p=0.0).top_p == 1.0 and request(top_p=1.5).top_p == 1.0


# --- the sampled distribution ---


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


# 99.99% quantile of chi-square with 7 degrees of freedom: a correct sampler fails this 1 time in 10^4.
CHI2_7DOF_LIMIT = 29.88


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_distribution_matches_softmax_over_temperature(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = sample_many(Sampler(8, CPU, seed=8), logits.expand(20000, -1).contiguous(), temperature=temperature)
    assert chi_square(tokens, torch.softmax(logits / temperature, dim=-1)) < CHI2_7DOF_LIMIT


def test_seeded_rows_are_distributed_like_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    rows = 5000
    reqs = [request(temperature=0.8, seed=seed) for seed in range(rows)]
    tokens = torch.tensor(Sampler(8, CPU)(logits.expand(rows, -1).contiguous(), reqs).token_ids)
    assert chi_square(tokens, torch.softmax(logits / 0.8, dim=-1)) < CHI2_7DOF_LIMIT


def reference_filtered_probs(logits: list[float], temperature, top_k, top_p, min_p) -> list[float]:
    """Slow float64 reference of temperature -> min-p -> top-k -> top-p; the distribution sampled from."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    keep = [w >= min_p for w in weights]  # w is p / p_max
    ranked = sorted(range(len(scaled)), key=lambda i: -scaled[i])
    if top_k > 0:
        for i in ranked[top_k:]:
            keep[i] = False
    total = sum(w for w, k in zip(weights, keep, strict=True) if k)
    mass_before = 0.0
    for i in ranked:
        if keep[i]:
            if mass_before >= top_p:
                keep[i] = False
            mass_before += weights[i] / total
    total = sum(w for w, k in zip(weights, keep, strict=True) if k)
    return [w / total if k else 0.0 for w, k in zip(weights, keep, strict=True)]


def test_filtered_distribution_matches_a_slow_reference():
    vocab, draws = 12, 2000
    gen = torch.Generator().manual_seed(18)
    cases = []
    for _ in range(16):
        logits = (torch.randn(vocab, generator=gen) * 2).tolist()
        temperature = 0.3 + 1.7 * torch.rand(1, generator=gen).item()
        top_k = int(torch.randint(0, vocab + 1, (1,), generator=gen))
        top_p = [1.0, 0.5, 0.8, 0.95][int(torch.randint(0, 4, (1,), generator=gen))]
        min_p = [0.0, 0.05, 0.2][int(torch.randint(0, 3, (1,), generator=gen))]
        cases.append((logits, temperature, top_k, top_p, min_p))
    rows = torch.tensor([case[0] for case in cases]).repeat_interleave(draws, dim=0)
    reqs = [request(temperature=t, top_k=k, top_p=p, min_p=m) for _, t, k, p, m in cases for _ in range(draws)]
    tokens = torch.tensor(Sampler(vocab, CPU, seed=9)(rows, reqs).token_ids).view(len(cases), draws)
    for case, drawn in zip(cases, tokens, strict=True):
        expected = reference_filtered_probs(*case)
        observed = torch.bincount(drawn, minlength=vocab).double() / draws
        for p, o in zip(expected, observed.tolist(), strict=True):
            if p == 0.0:
                assert o == 0.0, case
            else:
                assert abs(o - p) <= 4.5 * math.sqrt(p * (1 - p) / draws) + 1e-3, case


# --- logprobs ---


def test_logprobs_are_of_the_raw_logits_best_first():
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(15)) * 2
    reqs = [
        request(logprobs=5),
        request(logprobs=3, temperature=0.5, repetition_penalty=1.5, frequency_penalty=1.0, outputs=[1, 2, 2]),
        request(),
        request(logprobs=100, temperature=1.0, seed=3),
    ]
    out = Sampler(60, CPU)(logits.to(torch.bfloat16), reqs)
    reference = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    assert out.logprobs[2] is None
    for row, n in ((0, 5), (1, 3), (3, 20)):
        entry = out.logprobs[row]
        assert entry.token_id == out.token_ids[row]
        assert entry.logprob == pytest.approx(reference[row, entry.token_id].item(), abs=1e-5)
        assert len(entry.top) == n
        values = [top.logprob for top in entry.top]
        assert values == sorted(values, reverse=True)
        assert [top.token_id for top in entry.top] == reference[row].topk(n).indices.tolist()
        for top in entry.top:
            assert top.logprob == pytest.approx(reference[row, top.token_id].item(), abs=1e-5)
    assert out.logprobs[0].token_id == out.logprobs[0].top[0].token_id  # greedy picks the best
    assert math.isclose(sum(math.exp(v) for v in reference[0].tolist()), 1.0, rel_tol=1e-4)


def test_logprob_rows_do_not_change_the_caller_logits():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(16))
    before = logits.clone()
    Sampler(30, CPU)(logits, [request(logprobs=2, frequency_penalty=1.0, outputs=[3]), request(temperature=1.0)])
    assert logits.equal(before)


@pytest.mark.parametrize(
    ("fields", "eos", "outputs", "stopped_after"),
    [
        (dict(stop_token_ids=[7]), (2,), [5, 7, 9], 2),  # a stop token id
        (dict(), (2,), [5, 2], 2),  # EOS
        (dict(ignore_eos=True), (2,), [5, 2, 2], None),  # EOS ignored
        (dict(min_tokens=3), (2,), [2, 5, 2], 3),  # EOS before min_tokens is no stop (it is banned then)
        (dict(stop_token_ids=[7], max_tokens=2), (), [5, 5], None),  # the length is the scheduler's to end
    ],
)
def test_a_request_has_stopped_at_the_token_the_scheduler_ends_it_at(fields, eos, outputs, stopped_after):
    """The worker's record of a stop (plans of several steps end once every request has one) follows the
    scheduler's stop check: a stop token id, or EOS unless ignore_eos, once min_tokens are out."""
    state = RequestSampling.create(params(**fields), [1, 1], [], eos_token_ids=eos)
    seen = []
    for token in outputs:
        state.append(token)
        seen.append(state.stopped)
    assert seen == [stopped_after is not None and i + 1 >= stopped_after for i in range(len(outputs))]
