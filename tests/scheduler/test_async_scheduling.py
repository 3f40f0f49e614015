"""Async scheduling in the pure scheduler: plans made one step ahead give exactly the outputs of sync planning.

The fake model runs plans in order and keeps the token it sampled, as the worker
does, so a plan made before the previous result is back computes that token. A
few hundred mixed requests (shared prefixes, EOS stops found one step late,
min_tokens, length limits, a pool small enough to preempt, aborts at random
moments) must give every request the tokens of an unscheduled run, in both modes.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from services.scheduler.convert import plan_to_proto, sampled_from_proto
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from services.scheduler.step_plan import SchedulerOutput
from tests.scheduler.core import make_request, make_scheduler
from tests.scheduler.fake_worker import FakeModel, FakeWorkerConfig, next_token
from tests.scheduler.test_properties import check_invariants

VOCAB = 50
EOS = (0, 1, 2)  # about one token in 17 ends a request that does not ignore EOS


def reference(prompt: list[int], max_tokens: int, min_tokens: int, ignore_eos: bool, max_seq_len: int) -> list[int]:
    tokens, out = list(prompt), []
    while True:
        token = next_token(tokens, VOCAB)
        tokens.append(token)
        out.append(token)
        if len(out) >= min_tokens and not ignore_eos and token in EOS:
            return out
        if len(out) >= max_tokens or len(tokens) >= max_seq_len:
            return out


def workload(seed: int, num_requests: int) -> list[tuple[str, list[int], dict]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (0, 8, 13, 20)]
    requests = []
    for i in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        stop = dict(max_tokens=rng.randint(1, 24), min_tokens=rng.choice([0, 0, 3]), ignore_eos=rng.random() < 0.2)
        requests.append((f"r{i}", prompt, stop))
    return requests


class Run:
    """Requests arrive a few per step; ``depth`` plans may be in flight (2: async scheduling, 1: sync)."""

    def __init__(self, s: Scheduler, depth: int, seed: int, arrival_rate: float = 1.0):
        self.s = s
        # The chance that requests arrive before a step (plans of several steps are made only while none waits).
        self.arrival_rate = arrival_rate
        self.depth = depth
        self.rng = random.Random(seed)
        self.model = FakeModel(FakeWorkerConfig(num_blocks=s.kv.pool.num_blocks, block_size=s.kv.block_size))
        self.model.config.vocab_size = VOCAB
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, RequestStatus] = {}
        self.aborted: set[str] = set()
        self.num_steps = 0
        self.num_multi_step_plans = 0

    def go(self, requests, abort_rate: float) -> None:
        arrivals = deque(requests)
        in_flight: deque[tuple[SchedulerOutput, list]] = deque()
        while arrivals or self.s.has_work() or in_flight:
            for _ in range(self.rng.randint(0, 4) if self.rng.random() < self.arrival_rate else 0):
                if arrivals:
                    request_id, prompt, stop = arrivals.popleft()
                    self.s.add_request(make_request(request_id, prompt, **stop))
            if self.s.requests and self.rng.random() < abort_rate:
                self.abort(self.rng.choice(sorted(self.s.requests)))
            if len(in_flight) < self.depth and self.s.has_work():
                out = self.s.schedule()
                self.num_multi_step_plans += out.num_steps > 1
                if not out.is_empty:
                    # The worker runs plans in order: this one's tokens are sampled now, delivered later.
                    in_flight.append((out, sampled_from_proto(self.model.step(plan_to_proto(out)))))
                    if len(in_flight) < self.depth:
                        continue
            if in_flight:
                out, sampled = in_flight.popleft()
                self.deliver(self.s.update_from_output(out, sampled))
                self.num_steps += 1
            check_invariants(self.s)

    def abort(self, request_id: str) -> None:
        self.s.abort_request(request_id)
        self.aborted.add(request_id)
        self.finish[request_id] = RequestStatus.FINISHED_ABORTED

    def deliver(self, results) -> None:
        for r in results:
            request_id = r.request.request_id
            assert request_id not in self.finish, f"a token for {request_id} after it ended"
            self.outputs.setdefault(request_id, []).append(r.token_id)
            if r.finish is not None:
                self.finish[request_id] = r.finish


@pytest.mark.parametrize("steps", [1, 4], ids=["one-step-plans", "plans-of-4-steps"])
@pytest.mark.parametrize("num_blocks", [24, 400], ids=["preempting", "roomy"])
def test_async_and_sync_scheduling_give_the_unscheduled_tokens(num_blocks, steps):
    requests = workload(seed=num_blocks, num_requests=300)
    runs = {}
    for depth in (1, 2):
        s = make_scheduler(
            num_blocks, 4, max_num_seqs=16, max_num_batched_tokens=48, max_model_len=60, eos=EOS,
            num_scheduler_steps=steps,
        )  # fmt: skip
        run = runs[depth] = Run(s, depth, seed=7, arrival_rate=1.0 if steps == 1 else 0.1)
        run.go(requests, abort_rate=0.02)
        assert s.requests == {} and s.kv.pool.num_used_blocks == 0 and not s.running and not len(s.waiting)
        for request_id, prompt, stop in requests:
            expected = reference(prompt, **stop, max_seq_len=s.max_seq_len)
            got = run.outputs.get(request_id, [])
            if request_id in run.aborted:
                assert got == expected[: len(got)], request_id  # never a token that was not the model's
            else:
                assert got == expected, request_id
    if num_blocks == 24:
        assert all(run.s.num_preemptions > 10 for run in runs.values())
    finished = {rid for rid, *_ in requests} - runs[1].aborted - runs[2].aborted
    assert len(finished) > 200
    assert {rid: runs[1].outputs.get(rid) for rid in finished} == {rid: runs[2].outputs.get(rid) for rid in finished}
    if steps == 1:
        # Planning ahead never takes more steps: a step planned early is the same step.
        assert runs[2].num_steps <= runs[1].num_steps * 1.2
    else:  # plans of several steps were made, and stops inside them (EOS, length) cut some short
        assert min(run.num_multi_step_plans for run in runs.values()) > 50


def test_a_stop_found_one_step_late_discards_the_extra_token_and_frees_the_blocks():
    s = make_scheduler(16, 4, eos=EOS)
    model = FakeModel(FakeWorkerConfig(num_blocks=16, block_size=4))
    model.config.vocab_size = VOCAB
    prompt = [5, 6, 7]
    # Find a prompt whose first output is EOS, so the plan made ahead holds a request that is already done.
    while next_token(prompt, VOCAB) not in EOS:
        prompt = [prompt[0] + 1, *prompt[1:]]
    s.add_request(make_request("a", prompt, max_tokens=10))
    first = s.schedule()  # the prefill samples the EOS
    first_sampled = sampled_from_proto(model.step(plan_to_proto(first)))
    ahead = s.schedule()  # planned before the EOS is known: decodes "a" once more
    assert [p.request.request_id for p in ahead.running] == ["a"] and ahead.running[0].samples
    ahead_sampled = sampled_from_proto(model.step(plan_to_proto(ahead)))
    (result,) = s.update_from_output(first, first_sampled)
    assert result.finish is RequestStatus.FINISHED_STOPPED and result.token_id in EOS
    assert s.kv.pool.num_used_blocks == 0
    assert ahead_sampled and s.update_from_output(ahead, ahead_sampled) == []  # the extra token is dropped
    assert s.schedule().finished_ids == ["a"]  # and the worker is told to drop the request


def test_a_request_whose_last_token_is_in_flight_is_not_planned_again():
    s = make_scheduler(16, 4)
    s.add_request(make_request("a", [5, 6, 7], max_tokens=2))
    s.schedule()  # prefill: samples token 1
    ahead = s.schedule()  # decode: samples token 2, the last
    assert [p.request.request_id for p in ahead.running] == ["a"]
    assert s.schedule().is_empty  # token 2 ends "a" by length: nothing more to plan for it


def test_an_id_reused_while_the_old_request_s_token_is_in_flight_gets_only_its_own_tokens():
    s = make_scheduler(16, 4)
    model = FakeModel(FakeWorkerConfig(num_blocks=16, block_size=4))
    s.add_request(make_request("a", [5, 6, 7], max_tokens=8))
    first = s.schedule()
    first_sampled = sampled_from_proto(model.step(plan_to_proto(first)))
    s.abort_request("a")
    s.add_request(make_request("a", [9, 9], max_tokens=8))
    assert s.update_from_output(first, first_sampled) == []  # the old request's token is not the new one's
    out = s.schedule()
    assert out.finished_ids == ["a"] and [p.request.prompt_token_ids for p in out.new_requests] == [[9, 9]]
    (result,) = s.update_from_output(out, sampled_from_proto(model.step(plan_to_proto(out))))
    assert result.token_id == next_token([9, 9], 1000)
