"""Request state from StepPlans: new requests in full, then diffs, finished ids first; bad plans rejected whole."""

from __future__ import annotations

import pytest

from kvgrid.v1 import worker_pb2
from services.common.errors import InvalidArgument
from services.worker.request_state import RequestStates
from services.worker.sampling.request_sampling import RequestSampling


def states() -> RequestStates:
    return RequestStates(
        block_size=4,
        num_blocks=10,
        vocab_size=100,
        max_model_len=32,
        make_sampling=lambda params, prompt, outputs: RequestSampling.create(params, prompt, outputs),
    )


def new(rid, tokens, blocks, computed=0, scheduled=None, prompt=None):
    return worker_pb2.NewRequest(
        request_id=rid,
        token_ids=tokens,
        num_prompt_tokens=len(tokens) if prompt is None else prompt,
        block_ids=blocks,
        num_computed_tokens=computed,
        num_scheduled_tokens=len(tokens) - computed if scheduled is None else scheduled,
    )


def test_new_then_diffs_then_finished():
    s = states()
    (a,) = s.apply(worker_pb2.StepPlan(new_requests=[new("a", [1, 2, 3, 4, 5], [7, 2], scheduled=4)]))
    assert (a.block_ids, a.num_computed_tokens, a.num_scheduled_tokens, a.samples_this_step) == ([7, 2], 0, 4, False)
    a.num_computed_tokens = 4  # what the runner commits
    plan = worker_pb2.StepPlan(running=[worker_pb2.RunningRequest(request_id="a", num_scheduled_tokens=1)])
    (same,) = s.apply(plan)
    assert same is a and a.samples_this_step
    a.num_computed_tokens, a.token_ids = 5, a.token_ids + [9]  # the worker appends its sampled token
    plan = worker_pb2.StepPlan(
        running=[worker_pb2.RunningRequest(request_id="a", new_block_ids=[4], num_scheduled_tokens=1)]
    )
    s.apply(plan)
    assert a.block_ids == [7, 2, 4]
    assert s.apply(worker_pb2.StepPlan(finished_ids=["a"])) == [] and s.requests == {}


def test_resumed_request_keeps_outputs_for_sampling():
    s = states()
    (r,) = s.apply(worker_pb2.StepPlan(new_requests=[new("r", [5, 6, 7, 8, 9], [0, 1], computed=4, prompt=3)]))
    assert r.num_prompt_tokens == 3 and r.sampling.num_output_tokens == 2 and r.num_scheduled_tokens == 1


def test_finished_ids_are_dropped_before_new_requests():
    s = states()
    s.apply(worker_pb2.StepPlan(new_requests=[new("a", [1, 2], [0])]))
    (a,) = s.apply(worker_pb2.StepPlan(finished_ids=["a"], new_requests=[new("a", [1, 2, 3], [1])]))
    assert a.token_ids == [1, 2, 3] and a.block_ids == [1]


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        (worker_pb2.StepPlan(running=[worker_pb2.RunningRequest(request_id="x", num_scheduled_tokens=1)]), "running"),
        (worker_pb2.StepPlan(new_requests=[new("b", [1, 2, 3], [0])]), "request_id"),  # already known
        (worker_pb2.StepPlan(new_requests=[new("c", [1, 2, 3, 4, 5], [0])]), "block_ids"),  # 1 block, 5 tokens
        (worker_pb2.StepPlan(new_requests=[new("c", [1, 2], [10])]), "block_ids"),  # past the cache
        (worker_pb2.StepPlan(new_requests=[new("c", [1, 200], [0])]), "token_ids"),  # past the vocabulary
        (worker_pb2.StepPlan(new_requests=[new("c", [1, 2], [0], scheduled=3)]), "num_scheduled_tokens"),
        (worker_pb2.StepPlan(new_requests=[new("c", [1, 2], [0], scheduled=0)]), "num_scheduled_tokens"),
        (worker_pb2.StepPlan(new_requests=[new("c", [1] * 33, list(range(9)))]), "num_scheduled_tokens"),  # > max len
        (worker_pb2.StepPlan(new_requests=[new("c", [1, 2], [0], prompt=0)]), "num_prompt_tokens"),
    ],
)
def test_bad_plans_are_rejected_whole(plan, field):
    s = states()
    s.apply(worker_pb2.StepPlan(new_requests=[new("b", [1, 2], [3])]))
    plan.new_requests.append(new("ok", [1, 2], [4]))
    with pytest.raises(InvalidArgument) as err:
        s.apply(plan)
    assert field in err.value.field
    assert sorted(s.requests) == ["b"]  # nothing of the bad plan was applied


def _decoding(s: RequestStates):
    """Request "a": 3 prompt tokens computed, the first output sampled (4 known), one block of 4 held."""
    (a,) = s.apply(worker_pb2.StepPlan(new_requests=[new("a", [1, 2, 3], [0])]))
    a.num_computed_tokens, a.token_ids = 3, a.token_ids + [9]
    return a


def _run(num_steps: int, new_block_ids=(), scheduled: int = 1) -> worker_pb2.StepPlan:
    running = worker_pb2.RunningRequest(request_id="a", new_block_ids=new_block_ids, num_scheduled_tokens=scheduled)
    return worker_pb2.StepPlan(running=[running], num_steps=num_steps)


def test_a_plan_of_several_steps_needs_blocks_for_all_its_tokens():
    s = states()
    a = _decoding(s)
    assert s.apply(_run(4, [5])) == [a] and a.block_ids == [0, 5]  # positions 3..6
    a.num_computed_tokens, a.token_ids = 7, a.token_ids + [9, 9, 9, 9]
    with pytest.raises(InvalidArgument, match="blocks cannot hold") as err:
        s.apply(_run(2))  # positions 7..8: past the 2 blocks
    assert err.value.field == "running.block_ids"


@pytest.mark.parametrize(
    ("plan", "field"),
    [
        (worker_pb2.StepPlan(new_requests=[new("c", [1, 2], [4])], num_steps=2), "num_steps"),  # a new request
        (worker_pb2.StepPlan(num_steps=10**9), "num_steps"),  # nothing to run (would loop over no request)
        (_run(2, [5], scheduled=2), "num_steps"),  # more than one token in a step
        (_run(30, list(range(1, 9))), "running.num_scheduled_tokens"),  # 33 tokens: past max_model_len
    ],
)
def test_bad_plans_of_several_steps_are_rejected(plan, field):
    s = states()
    _decoding(s)
    with pytest.raises(InvalidArgument) as err:
        s.apply(plan)
    assert err.value.field == field


def test_a_plan_of_several_steps_is_refused_for_a_request_that_does_not_sample():
    s = states()
    (a,) = s.apply(worker_pb2.StepPlan(new_requests=[new("a", [1, 2, 3, 4, 5], [0, 1], scheduled=2)]))
    a.num_computed_tokens = 2  # a prefill chunk: 3 prompt tokens left
    with pytest.raises(InvalidArgument, match="repeats decodes only"):
        s.apply(_run(2))
