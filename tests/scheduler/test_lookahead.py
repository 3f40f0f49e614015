"""Lookahead slots for speculative decoding, against a fake model that accepts some proposals each step.

The fake model writes wrong K/V (-1) into the slots of rejected proposals and checks every prefix-cache hit
reads back the right tokens, so a block registered with a rejected proposal in it fails the run.
"""

from __future__ import annotations

import random

from services.scheduler.lookahead import Lookahead
from services.scheduler.request import RequestStatus
from tests.scheduler.core import VOCAB, Driver, make_request, make_scheduler
from tests.scheduler.fake_worker import generate
from tests.scheduler.test_properties import check_invariants


def spec_scheduler(k: int = 3, disable_by_batch_size: int = 0, **limits):
    s = make_scheduler(**limits)
    s.lookahead = Lookahead(k, disable_by_batch_size)
    return s


def test_a_decode_row_gets_lookahead_slots_and_accepted_tokens_count_as_computed():
    s = spec_scheduler(k=3, num_blocks=16, block_size=4)
    d = Driver(s)
    s.add_request(make_request("a", [5, 6, 7], max_tokens=40))
    out, _ = d.step()  # the prefill samples one token, no lookahead
    assert not out.running
    out, results = d.step()
    (plan,) = out.running
    assert (plan.num_scheduled_tokens, plan.num_lookahead_tokens) == (1, 3)
    request = s.requests["a"]
    # Blocks for the scheduled token and 3 proposals: positions 3..6 (the prompt has 3 tokens, one output).
    assert len(s.kv.blocks_of("a")) * 4 >= 3 + 1 + 3
    assert 1 <= len(results) <= 4
    assert request.num_computed_tokens == request.num_tokens - 1 and request.num_output_placeholders == 0
    assert d.run()["a"] == generate([5, 6, 7], 40, VOCAB)
    assert s.kv.pool.num_used_blocks == 0


def test_lookahead_never_passes_max_tokens_or_the_budget():
    s = spec_scheduler(k=5, num_blocks=32, block_size=4, max_num_batched_tokens=4)
    d = Driver(s)
    s.add_request(make_request("a", [1, 2], max_tokens=3))
    d.step()
    out, _ = d.step()
    assert out.running[0].num_lookahead_tokens == 1  # one output so far, 3 at most: this step's token and one more
    s.add_request(make_request("b", [3, 4], max_tokens=50))
    s.add_request(make_request("c", [5, 6], max_tokens=50))
    d.run()
    assert d.outputs["a"] == generate([1, 2], 3, VOCAB)
    assert d.outputs["b"] == generate([3, 4], 50, VOCAB)


def test_no_lookahead_above_disable_by_batch_size():
    s = spec_scheduler(k=2, disable_by_batch_size=1, num_blocks=32, block_size=4)
    d = Driver(s)
    s.add_request(make_request("a", [1, 2], max_tokens=20))
    s.add_request(make_request("b", [3, 4], max_tokens=20))
    d.step()
    out, _ = d.step()
    assert [p.num_lookahead_tokens for p in out.running] == [0, 0]
    s.abort_request("b")
    out, _ = d.step()
    assert [p.num_lookahead_tokens for p in out.running] == [2]


def test_a_stop_token_inside_the_accepted_run_truncates_it():
    expected = generate([9, 8, 7], 30, VOCAB)
    stop = expected[6]
    s = spec_scheduler(k=4, num_blocks=16, block_size=4)
    d = Driver(s)
    s.add_request(make_request("a", [9, 8, 7], max_tokens=30, stop_token_ids=frozenset({stop})))
    d.run()
    assert d.outputs["a"] == expected[: expected.index(stop) + 1]
    assert s.kv.pool.num_used_blocks == 0


def test_mixed_run_with_preemption_and_aborts_gives_the_same_tokens_as_without():
    rng = random.Random(7)
    prompts = {f"r{i}": [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))] for i in range(40)}
    max_tokens = {rid: rng.randrange(1, 30) for rid in prompts}
    s = spec_scheduler(k=3, num_blocks=24, block_size=4, max_num_seqs=6, max_num_batched_tokens=16)
    d = Driver(s)
    aborted = set()
    pending = list(prompts)
    for _ in range(2000):
        for _ in range(rng.randrange(0, 3)):
            if pending:
                rid = pending.pop(0)
                s.add_request(make_request(rid, prompts[rid], max_tokens=max_tokens[rid]))
        if s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(s.requests))
            assert s.abort_request(rid).status is RequestStatus.FINISHED_ABORTED
            aborted.add(rid)
        if not s.has_work() and not pending:
            break
        if s.has_work():
            d.step()
        check_invariants(s)
    assert not pending and not s.has_work()
    assert s.num_preemptions > 0
    for rid, prompt in prompts.items():
        want = generate(prompt, max_tokens[rid], VOCAB)
        got = d.outputs.get(rid, [])
        if rid in aborted:
            assert got == want[: len(got)]
        else:
            assert got == want, rid
