"""Plans of several decode steps: when they are made, how long they are, and what a stop inside one does."""

from __future__ import annotations

import pytest

from services.common.config import SchedulerConfig
from services.scheduler.convert import plan_to_proto, sampled_from_proto
from services.scheduler.plan_steps import MAX_PLAN_STEPS, PLAN_SECONDS, describe
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import WorkerProtocolError
from tests.scheduler.core import Driver, make_request, make_scheduler
from tests.scheduler.fake_worker import generate, next_token


def decoding(num_scheduler_steps: int, max_tokens: int = 64, **kwargs) -> Driver:
    """A driver whose one request has had its prefill step (so the next plan decodes it)."""
    d = Driver(make_scheduler(64, 4, num_scheduler_steps=num_scheduler_steps, **kwargs))
    d.scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=max_tokens))
    out, _ = d.step()
    assert out.num_steps == 1 and out.new_requests
    return d


def test_auto_takes_as_many_steps_as_fit_the_plan_time_at_the_last_decode_step_s_time():
    d = decoding(0)
    s = d.scheduler
    assert d.step()[0].num_steps == 1  # no decode step timed yet
    for seconds, steps in [(PLAN_SECONDS / 5, 5), (PLAN_SECONDS * 2, 1), (PLAN_SECONDS / 100, MAX_PLAN_STEPS)]:
        out = s.schedule()
        s.plan_steps.record(out, seconds * out.num_steps)  # a plan's time is all its steps'
        d.answer(out)
        assert s.plan_steps.decode_step_seconds == seconds
        assert d.step()[0].num_steps == steps


def test_a_prefill_step_s_time_does_not_size_plans():
    d = decoding(0)
    s = d.scheduler
    out = s.schedule()
    s.plan_steps.record(out, PLAN_SECONDS / 4)
    d.answer(out)
    s.add_request(make_request("b", list(range(10, 30)), max_tokens=30))
    prefill = s.schedule()
    assert prefill.new_requests and prefill.num_steps == 1  # something waited: one step
    s.plan_steps.record(prefill, 10.0)
    d.answer(prefill)
    assert s.plan_steps.decode_step_seconds == PLAN_SECONDS / 4 and d.step()[0].num_steps == 4


def test_plans_never_reach_past_max_tokens_and_give_the_model_s_tokens():
    d = decoding(4, max_tokens=7)
    steps = [d.step()[0].num_steps for _ in range(2)]
    assert steps == [4, 2]  # 1 token from the prefill, then 4, then the 2 left
    assert d.scheduler.requests == {}  # finished by length with its 7th token
    assert d.outputs["a"] == generate([5, 6, 7], 7, 1000)


def test_one_step_while_a_request_waits_or_one_is_structured_or_prefills():
    d = decoding(4)
    s = d.scheduler
    s.add_request(make_request("b", [9] * 40, max_tokens=4))
    s.limits.max_num_batched_tokens = 8  # b's prompt takes several chunks
    out, _ = d.step()
    assert out.new_requests and out.num_steps == 1  # b waited until this plan
    while out.total_num_scheduled_tokens > len(out.running):  # b's prompt goes in chunks: one step each
        assert out.num_steps == 1
        out, _ = d.step()
    assert d.step()[0].num_steps == 4  # both decode
    s.add_request(make_request("c", [3, 4], max_tokens=30, structured=True))
    assert all(d.step()[0].num_steps == 1 for _ in range(5))


def test_a_stop_inside_a_plan_drops_the_tokens_after_it_and_frees_the_blocks():
    eos = next_token([5, 6, 7, *generate([5, 6, 7], 2, 1000)], 1000)  # the 3rd output token ends the request
    d = Driver(make_scheduler(64, 4, num_scheduler_steps=4, eos=(eos,)))
    d.scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=50))
    d.step()
    out, results = d.step()
    assert out.num_steps == 4
    assert [r.token_id for r in results] == generate([5, 6, 7], 3, 1000)[1:]  # 2 of the plan's 4 tokens
    assert results[-1].finish is RequestStatus.FINISHED_STOPPED
    assert d.scheduler.kv.pool.num_used_blocks == 0 and d.scheduler.schedule().finished_ids == ["a"]


def _ended_early(cut: int) -> tuple[Driver, list]:
    """One request (prompt [5, 6, 7], blocks of 2) whose 3rd output token is EOS, in a plan of 4 steps the worker
    answers with only its first ``cut`` tokens; returns the driver and the plan's results."""
    eos = next_token([5, 6, 7, *generate([5, 6, 7], 2, 1000)], 1000)
    d = Driver(make_scheduler(64, 2, num_scheduler_steps=4, eos=(eos,)))
    d.scheduler.add_request(make_request("a", [5, 6, 7], max_tokens=50))
    d.step()
    out = d.scheduler.schedule()
    assert out.num_steps == 4
    sampled = sampled_from_proto(d.model.step(plan_to_proto(out)))[:cut]
    return d, d.scheduler.update_from_output(out, sampled)


def test_a_plan_the_worker_ends_at_its_request_s_stop_gives_the_same_tokens_and_caches_only_computed_blocks():
    d, results = _ended_early(2)  # steps 1 and 2 ran: the 2nd sampled the EOS
    assert [r.token_id for r in results] == generate([5, 6, 7], 3, 1000)[1:]
    assert results[-1].finish is RequestStatus.FINISHED_STOPPED
    assert d.scheduler.kv.pool.num_used_blocks == 0
    # Known: the prompt and 3 outputs (6 tokens); K/V computed for 5 of them (the EOS is never computed), so
    # 2 blocks of 2 are registered for reuse, not the 3rd, which holds the EOS's position.
    assert len(d.scheduler.kv.pool.cached_hashes()) == 2


def test_a_plan_cut_short_without_a_stop_is_a_protocol_error():
    with pytest.raises(WorkerProtocolError, match="did not stop"):
        _ended_early(1)  # 1 of 4 tokens, and it is no stop


def test_a_pool_without_room_for_the_plan_s_tokens_plans_one_step_without_preempting():
    # 5 blocks of 4. After the prefills and a plan of 4 steps each request has computed 7 tokens in 2 blocks;
    # 4 more steps would take a third block each, and one is free: a takes it, b plans one step in its own.
    d = Driver(make_scheduler(5, 4, num_scheduler_steps=4))
    for request_id in "ab":
        d.scheduler.add_request(make_request(request_id, [5, 6, 7], max_tokens=20))
    steps = [d.step()[0].num_steps for _ in range(3)]
    assert steps == [1, 4, 1]
    assert d.scheduler.num_preemptions == 0 and d.outputs["a"] == d.outputs["b"] == generate([5, 6, 7], 6, 1000)


def test_the_flag_s_help_and_the_log_state_the_auto_rule_s_numbers():
    rule = (f"{PLAN_SECONDS * 1000:g} ms", f"at most {MAX_PLAN_STEPS}")
    help_text = SchedulerConfig.__dataclass_fields__["num_scheduler_steps"].metadata["help"]
    assert all(part in help_text and part in describe(0) for part in rule), (help_text, describe(0))
    assert describe(0).startswith("auto") and describe(3) == "3"
