"""Seeded sampling: the same tokens across runs, batch companions and preemption; the worker's seed."""

from __future__ import annotations

import pytest
import torch

from services.worker.sampling.sampler import RequestSampling, Sampler
from tests.worker.test_sampling import CPU, logits_from_probs, params, request, sample_many, shuffled

# --- seeds ---


def step_logits(step: int, vocab: int = 97) -> torch.Tensor:
    """The (fixed) logits a request sees at one step, as if from the model."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 2.0


def companion_logits(step: int, rows: int, vocab: int = 97) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(5000 + step)) * 2.0


def run_seeded(
    sampler: Sampler, fields: dict, steps: range, companions: int, position: int, outputs: list[int]
) -> list[int]:
    """Generate len(steps) tokens for one seeded request, at batch row ``position`` among fresh companions."""
    me = RequestSampling.create(params(**fields), [5, 6, 7], outputs)
    produced = []
    companion_kinds = [dict(temperature=1.0), dict(), dict(temperature=0.7, seed=99), dict(top_p=0.5, temperature=1.0)]
    for step in steps:
        others = [request(**companion_kinds[i % len(companion_kinds)]) for i in range(companions)]
        rows = companion_logits(step, companions)
        logits = torch.cat([rows[:position], step_logits(step).unsqueeze(0), rows[position:]]).to(sampler.device)
        token = sampler(logits, others[:position] + [me] + others[position:]).token_ids[position]
        me.append(token)
        produced.append(token)
    return produced


SEEDED = dict(temperature=1.0, top_p=0.95, seed=1234, frequency_penalty=0.3)


def test_same_seed_same_tokens_across_runs():
    first = run_seeded(Sampler(97, CPU), SEEDED, range(12), companions=0, position=0, outputs=[])
    again = run_seeded(Sampler(97, CPU), SEEDED, range(12), companions=0, position=0, outputs=[])
    other_seed = run_seeded(Sampler(97, CPU), {**SEEDED, "seed": 4321}, range(12), 0, 0, [])
    assert first == again
    assert first != other_seed


@pytest.mark.parametrize(("companions", "position"), [(1, 0), (1, 1), (3, 2), (7, 5)])
def test_seeded_tokens_do_not_depend_on_batch_companions(companions, position):
    alone = run_seeded(Sampler(97, CPU, seed=1), SEEDED, range(12), companions=0, position=0, outputs=[])
    batched = run_seeded(Sampler(97, CPU, seed=2), SEEDED, range(12), companions, position, outputs=[])
    assert batched == alone


def test_seeded_tokens_survive_preemption():
    straight = run_seeded(Sampler(97, CPU), SEEDED, range(12), companions=2, position=1, outputs=[])
    # Preempted after 5 tokens: recreated with its outputs, it continues on a fresh batch layout.
    before = run_seeded(Sampler(97, CPU), SEEDED, range(5), companions=1, position=0, outputs=[])
    after = run_seeded(Sampler(97, CPU), SEEDED, range(5, 12), companions=3, position=3, outputs=before)
    assert before + after == straight


def test_unseeded_requests_follow_the_worker_seed():
    logits = torch.randn(6, 97, generator=torch.Generator().manual_seed(11))

    def run(sampler_seed, default_seed):
        sampler = Sampler(97, CPU, seed=sampler_seed)
        reqs = [RequestSampling.create(params(temperature=1.0), [], [], default_seed=default_seed) for _ in range(6)]
        return [sampler(logits, reqs).token_ids for _ in range(5)]

    assert run(7, None) == run(7, None)
    assert run(None, 7) == run(None, 7) == run(7, None)
    assert run(None, 7) != run(None, 8)


# --- the same guarantees on a GPU (skipped without one) ---


@pytest.mark.cuda
def test_cuda_sampler():
    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(19)
    logits = torch.randn(8, 97, generator=gen) * 3
    assert Sampler(97, cuda)(logits.to(cuda, torch.bfloat16), [request()] * 8).token_ids == (
        logits.to(torch.bfloat16).float().argmax(-1).tolist()
    )
    alone = run_seeded(Sampler(97, cuda, seed=1), SEEDED, range(12), companions=0, position=0, outputs=[])
    batched = run_seeded(Sampler(97, cuda, seed=2), SEEDED, range(12), companions=5, position=3, outputs=[])
    before = run_seeded(Sampler(97, cuda), SEEDED, range(5), companions=1, position=0, outputs=[])
    after = run_seeded(Sampler(97, cuda), SEEDED, range(5, 12), companions=3, position=3, outputs=before)
    assert batched == alone == before + after
    probs, column = shuffled([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02], seed=5)
    tokens = sample_many(Sampler(7, cuda, seed=2), logits_from_probs(probs, 4000).to(cuda), temperature=1.0, top_p=0.7)
    assert set(tokens.tolist()) == {column[0], column[1], column[2]}
    out = Sampler(97, cuda)(logits.to(cuda), [request(logprobs=4, frequency_penalty=1.0, outputs=[1, 1])] * 8)
    reference = torch.log_softmax(logits, dim=-1)
    for row, entry in enumerate(out.logprobs):
        assert [top.token_id for top in entry.top] == reference[row].topk(4).indices.tolist()
        assert entry.logprob == pytest.approx(reference[row, entry.token_id].item(), abs=1e-4)
