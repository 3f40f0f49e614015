"""Prompt logprobs in the pure scheduler: a request scoring its prompt reads no cached prefix, its logprobs gather
across chunks and preemptions (each position once, in order) and leave with its first token."""

from __future__ import annotations

import pytest

from services.scheduler.convert import plan_to_proto, sampled_from_proto
from services.scheduler.scheduler import WorkerProtocolError
from tests.scheduler.core import Driver, make_request, make_scheduler


def scoring(request_id: str, prompt: list[int], max_tokens: int = 16, **stop):
    request = make_request(request_id, prompt, max_tokens, **stop)
    request.wants_prompt_logprobs = True
    return request


def scored(out, skip_done: bool = True) -> list[tuple[str, int, list[int]]]:
    """What a worker scores for ``out``: per request wanting them, the prompt positions its step computes the
    logits of, as entries equal to the position scored (a worker with ``skip_done`` off repeats those done)."""
    chunks = []
    for plan, start, num in [
        *((p, p.num_computed_tokens, p.num_scheduled_tokens) for p in out.new_requests),
        *((p, p.request.num_computed_tokens - p.num_scheduled_tokens, p.num_scheduled_tokens) for p in out.running),
    ]:
        request = plan.request
        if not request.wants_prompt_logprobs:
            continue
        first = start + 1
        if skip_done and plan in out.new_requests:
            sent = plan_to_proto(out).new_requests[out.new_requests.index(plan)]
            first = max(first, sent.num_prompt_logprobs_done + 1)
        last = min(start + num, request.num_prompt_tokens - 1)
        if first <= last:
            chunks.append((request.request_id, first, list(range(first, last + 1))))
    return chunks


def step(d: Driver, skip_done: bool = True):
    out = d.scheduler.schedule()
    sampled = sampled_from_proto(d.model.step(plan_to_proto(out)))
    return out, d.scheduler.update_from_output(out, sampled, scored(out, skip_done))


def test_a_scoring_request_reads_no_cached_prefix_and_a_plain_one_does():
    s = make_scheduler(num_blocks=16, block_size=4)
    d = Driver(s)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    s.add_request(make_request("a", prefix + [9], max_tokens=1))
    step(d)
    s.add_request(scoring("b", prefix + [10, 11], max_tokens=1))
    s.add_request(make_request("c", prefix + [12], max_tokens=1))
    out, outputs = step(d)
    assert [(p.request.request_id, p.num_computed_tokens) for p in out.new_requests] == [("b", 0), ("c", 8)]
    (b_out,) = [o for o in outputs if o.request.request_id == "b"]
    assert b_out.prompt_logprobs == list(range(1, 10))  # tokens 1..9 of 10
    assert s.requests == {}


@pytest.mark.parametrize("skip_done", [True, False])
def test_logprobs_gather_across_chunks_and_a_preemption_once_each(skip_done):
    s = make_scheduler(num_blocks=6, block_size=2, max_num_batched_tokens=4)
    d = Driver(s)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=12))
    prompt = list(range(20, 29))  # 9 tokens: chunks of at most 4 tokens a step
    s.add_request(scoring("b", prompt, max_tokens=2))
    b = s.requests["b"]
    done_when_preempted = done_when_resumed = None
    b_outputs = []
    for _ in range(100):
        if not s.has_work():
            break
        out, outputs = step(d, skip_done)
        if "b" in out.preempted_ids and done_when_preempted is None:
            done_when_preempted = b.num_prompt_logprobs
        for new in plan_to_proto(out).new_requests:
            if new.request_id == "b" and done_when_preempted is not None and done_when_resumed is None:
                done_when_resumed = new.num_prompt_logprobs_done
        b_outputs += [o for o in outputs if o.request is b]
    assert 0 < done_when_preempted < len(prompt) - 1  # preempted part way through its prompt
    assert done_when_resumed == done_when_preempted
    assert len(b_outputs) == 2 and b_outputs[1].prompt_logprobs is None
    assert b_outputs[0].prompt_logprobs == list(range(1, len(prompt)))  # each position once, in order


def test_skipped_positions_are_a_protocol_error():
    s = make_scheduler(num_blocks=16, block_size=4)
    d = Driver(s)
    s.add_request(scoring("b", list(range(10, 20)), max_tokens=1))
    out = s.schedule()
    sampled = sampled_from_proto(d.model.step(plan_to_proto(out)))
    with pytest.raises(WorkerProtocolError, match="expected 1"):
        s.update_from_output(out, sampled, [("b", 3, [3, 4, 5, 6, 7, 8, 9])])
