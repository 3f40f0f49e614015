"""Micro-batches (a worker of P pipeline stages): up to P plans in flight, never two holding the same request.

The same mixed workload as async scheduling (shared prefixes, late stops, a pool small enough to preempt, aborts)
gives every request the tokens of an unscheduled run, while the fake worker checks each plan against the ones
still in flight and counts how often two or more ran at once.
"""

from __future__ import annotations

from collections import deque

import pytest

from services.scheduler.convert import plan_to_proto, sampled_from_proto
from services.scheduler.micro_batches import MicroBatches
from services.scheduler.step_plan import SchedulerOutput
from tests.scheduler.core import make_request, make_scheduler
from tests.scheduler.test_async_scheduling import EOS, Run, reference, workload
from tests.scheduler.test_properties import check_invariants


def held(out: SchedulerOutput) -> set[str]:
    return {plan.request.request_id for plan in (*out.running, *out.new_requests)}


class MicroBatchRun(Run):
    """``Run`` with the engine's bookkeeping of micro-batches; records the most plans in flight at once."""

    def __init__(self, s, stages: int, seed: int):
        super().__init__(s, stages, seed)
        self.micro = s.micro_batches = MicroBatches(stages)
        self.most_in_flight = 0

    def go(self, requests, abort_rate: float) -> None:
        arrivals = deque(requests)
        in_flight: deque[tuple[SchedulerOutput, list]] = deque()
        while arrivals or self.s.has_work() or in_flight:
            for _ in range(self.rng.randint(0, 4)):
                if arrivals:
                    request_id, prompt, stop = arrivals.popleft()
                    self.s.add_request(make_request(request_id, prompt, **stop))
            if self.s.requests and self.rng.random() < abort_rate:
                self.abort(self.rng.choice(sorted(self.s.requests)))
            if len(in_flight) < self.depth and self.s.has_work():
                out = self.s.schedule()
                if not out.is_empty:
                    for earlier, _ in in_flight:
                        assert not held(out) & held(earlier), "a request in two micro-batches at once"
                    self.micro.sent(out)
                    in_flight.append((out, sampled_from_proto(self.model.step(plan_to_proto(out)))))
                    if held(out) and sum(1 for o, _ in in_flight if held(o)) > 1:
                        self.most_in_flight = max(self.most_in_flight, sum(1 for o, _ in in_flight if held(o)))
                    if len(in_flight) < self.depth:
                        continue
            if in_flight:
                out, sampled = in_flight.popleft()
                self.micro.done(out)
                self.deliver(self.s.update_from_output(out, sampled))
                self.num_steps += 1
            check_invariants(self.s)


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("num_blocks", [24, 400], ids=["preempting", "roomy"])
def test_micro_batches_hold_disjoint_requests_and_give_the_unscheduled_tokens(num_blocks, stages):
    requests = workload(seed=num_blocks, num_requests=300)
    s = make_scheduler(num_blocks, 4, max_num_seqs=16, max_num_batched_tokens=48, max_model_len=60, eos=EOS)
    run = MicroBatchRun(s, stages, seed=7)
    run.go(requests, abort_rate=0.02)
    assert s.requests == {} and s.kv.pool.num_used_blocks == 0 and not s.running and not len(s.waiting)
    for request_id, prompt, stop in requests:
        expected = reference(prompt, **stop, max_seq_len=s.max_seq_len)
        got = run.outputs.get(request_id, [])
        if request_id in run.aborted:
            assert got == expected[: len(got)], request_id
        else:
            assert got == expected, request_id
    assert run.most_in_flight == stages  # every stage had a micro-batch of its own at some point
    if num_blocks == 24:
        assert s.num_preemptions > 10


def test_one_plan_takes_a_stage_s_share_of_the_running_requests():
    s = make_scheduler(64, 4)
    s.micro_batches = MicroBatches(2)
    for i in range(5):
        s.add_request(make_request(f"r{i}", [5, 6, 7]))
    prefill = s.schedule()  # all five are new: admitted together
    s.micro_batches.sent(prefill)
    assert len(prefill.new_requests) == 5 and s.schedule().is_empty  # each waits for its first token
    s.micro_batches.done(prefill)
    s.update_from_output(prefill, [(f"r{i}", 9, None) for i in range(5)])
    first, second = s.schedule(), None
    s.micro_batches.sent(first)
    second = s.schedule()
    assert [p.request.request_id for p in first.running] == ["r0", "r1", "r2"]
    assert [p.request.request_id for p in second.running] == ["r3", "r4"]


def test_plans_stand_for_one_step_while_the_running_requests_can_be_split():
    steps = {}
    for micro in (True, False):
        s = make_scheduler(64, 4, num_scheduler_steps=4)
        s.micro_batches = MicroBatches(2) if micro else None
        for i in range(2):
            s.add_request(make_request(f"r{i}", [5, 6, 7], max_tokens=20))
        prefill = s.schedule()
        if micro:
            s.micro_batches.sent(prefill)
            s.micro_batches.done(prefill)
        s.update_from_output(prefill, [(f"r{i}", 9, None) for i in range(2)])
        steps[micro] = s.schedule().num_steps
    assert steps == {True: 1, False: 4}  # without micro-batches the same decodes are planned 4 steps at once
