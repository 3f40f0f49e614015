"""Repetition, frequency and presence penalties against a slow reference; stop tokens banned until min_tokens."""

from __future__ import annotations

import torch

from services.worker.sampling.penalties import apply_penalties, gather_penalty_state, penalty_params
from services.worker.sampling.request_sampling import PENDING_FLUSH_LIMIT
from services.worker.sampling.sampler import RequestSampling, Sampler
from tests.worker.test_sampling import CPU, params, request

# --- penalties ---


def reference_penalties(logits: list[float], prompt: list[int], outputs: list[int], rep, freq, pres) -> list[float]:
    out = list(logits)
    for token in set(prompt) | set(outputs):
        out[token] = out[token] / rep if out[token] > 0 else out[token] * rep
    for token in set(outputs):
        out[token] -= freq * outputs.count(token) + pres
    return out


PENALTY_CASES = [
    dict(repetition_penalty=1.3),
    dict(frequency_penalty=0.7),
    dict(presence_penalty=-0.9),
    dict(repetition_penalty=0.8, frequency_penalty=-0.4, presence_penalty=1.1),
    dict(frequency_penalty=2.0, presence_penalty=2.0),
]


def test_penalties_match_the_formula():
    vocab = 30
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(len(PENALTY_CASES), vocab, generator=gen) * 3
    reqs, expected = [], []
    for row, case in enumerate(PENALTY_CASES):
        prompt = torch.randint(0, vocab, (8,), generator=gen).tolist()
        outputs = torch.randint(0, vocab, (12,), generator=gen).tolist()
        reqs.append(request(prompt, outputs, **case))
        rep = case.get("repetition_penalty", 1.0)
        freq, pres = case.get("frequency_penalty", 0.0), case.get("presence_penalty", 0.0)
        expected.append(reference_penalties(logits[row].tolist(), prompt, outputs, rep, freq, pres))
    counts, prompt_mask = gather_penalty_state(reqs, vocab, CPU)
    got = apply_penalties(logits.clone(), counts, prompt_mask, penalty_params(reqs, CPU))
    torch.testing.assert_close(got, torch.tensor(expected))


def test_penalised_greedy_rows_take_the_argmax_of_the_penalised_logits():
    vocab = 20
    gen = torch.Generator().manual_seed(13)
    for _ in range(20):
        logits = torch.randn(3, vocab, generator=gen)
        prompt = torch.randint(0, vocab, (6,), generator=gen).tolist()
        outputs = torch.randint(0, vocab, (6,), generator=gen).tolist()
        cases = [dict(repetition_penalty=2.0), dict(frequency_penalty=1.0), dict(presence_penalty=1.5)]
        out = Sampler(vocab, CPU)(logits, [request(prompt, outputs, **case) for case in cases])
        for row, case in enumerate(cases):
            ref = reference_penalties(
                logits[row].tolist(),
                prompt,
                outputs,
                case.get("repetition_penalty", 1.0),
                case.get("frequency_penalty", 0.0),
                case.get("presence_penalty", 0.0),
            )
            assert out.token_ids[row] == max(range(vocab), key=ref.__getitem__)


def test_append_updates_counts_across_steps_and_flushes():
    vocab = 10
    me = request([1, 2], [3], frequency_penalty=1.0)
    sampler = Sampler(vocab, CPU)
    outputs = [3]
    gen = torch.Generator().manual_seed(14)
    for step in range(3 * PENDING_FLUSH_LIMIT):
        if step % 5 == 0:  # a step runs the sampler: pending tokens move into device counts
            sampler(torch.zeros(1, vocab), [me])
        token = int(torch.randint(0, vocab, (1,), generator=gen))
        me.append(token)
        outputs.append(token)
    counts, prompt_mask = gather_penalty_state([me], vocab, CPU)
    assert counts[0].tolist() == [outputs.count(t) for t in range(vocab)]
    assert prompt_mask[0].tolist() == [t in (1, 2) for t in range(vocab)]
    assert len(me.pending_token_ids) < PENDING_FLUSH_LIMIT
    assert me.num_output_tokens == len(outputs)
    # Gathering twice must not count the pending tokens twice.
    counts_again, _ = gather_penalty_state([me], vocab, CPU)
    assert counts_again.equal(counts)


def test_token_ids_outside_the_vocabulary_are_ignored_by_penalties():
    me = request([1, 500], [2, 900], repetition_penalty=2.0, frequency_penalty=1.0)
    counts, prompt_mask = gather_penalty_state([me], 10, CPU)
    assert counts[0].tolist() == [0, 0, 1] + [0] * 7
    assert prompt_mask[0].nonzero().flatten().tolist() == [1]


# --- min_tokens ---


def test_stop_tokens_are_banned_until_min_tokens():
    vocab, eos, stop = 12, 7, 5
    logits = torch.zeros(1, vocab)
    logits[0, eos], logits[0, stop], logits[0, 2] = 9.0, 8.0, 1.0  # EOS, then the stop token, would win
    sampler = Sampler(vocab, CPU)

    def generate(num_tokens: int, **fields) -> list[int]:
        me = RequestSampling.create(params(**fields), [1], [], eos_token_ids=[eos])
        produced = []
        for _ in range(num_tokens):
            produced.append(sampler(logits, [me]).token_ids[0])
            me.append(produced[-1])
        return produced

    assert generate(5, min_tokens=3, stop_token_ids=[stop]) == [2, 2, 2, eos, eos]
    assert generate(5, min_tokens=3, stop_token_ids=[stop], ignore_eos=True) == [eos] * 5
    assert generate(2, min_tokens=3, stop_token_ids=[stop], ignore_eos=True, temperature=1e-3) == [eos] * 2
    assert generate(3, min_tokens=2) == [stop, stop, eos]  # only EOS is banned: 5 is no stop token here
    assert RequestSampling.create(params(min_tokens=4), [1], []).plain_greedy  # nothing to ban
    # A resumed request counts its earlier outputs towards min_tokens.
    resumed = RequestSampling.create(params(min_tokens=3), [1], [2, 2, 2], eos_token_ids=[eos])
    assert resumed.plain_greedy
    assert sampler(logits, [resumed]).token_ids == [eos]
    # Sampled rows: the ban holds over many draws.
    reqs = [RequestSampling.create(params(temperature=1.0, min_tokens=1), [], [], eos_token_ids=[eos, stop])] * 500
    assert not {eos, stop} & set(sampler(logits.expand(500, -1).contiguous(), reqs).token_ids)
