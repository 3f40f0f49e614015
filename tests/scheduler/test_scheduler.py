"""The pure scheduler from plain numbers, answered by a fake model: plans, splits, preemption, stops, aborts."""

from __future__ import annotations

import pytest

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import WorkerProtocolError
from tests.scheduler.core import VOCAB, Driver, make_request, make_scheduler
from tests.scheduler.fake_worker import generate

SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4


def new_plans(out):
    return [
        (p.request.request_id, p.block_ids, p.num_computed_tokens, p.num_scheduled_tokens) for p in out.new_requests
    ]


def running_plans(out):
    return [(p.request.request_id, p.new_block_ids, p.num_scheduled_tokens) for p in out.running]


def test_requests_sharing_a_system_prompt_hit_the_prefix_cache():
    s = make_scheduler(num_blocks=16, block_size=4)
    d = Driver(s)
    s.add_request(make_request("a", SYSTEM + [20, 21, 22]))
    out, _ = d.step()
    assert new_plans(out) == [("a", [0, 1, 2], 0, 11)]

    s.add_request(make_request("b", SYSTEM + [30, 31]))
    s.add_request(make_request("c", SYSTEM))  # the whole prompt is cached, but its last token is recomputed
    out, _ = d.step()
    assert running_plans(out) == [("a", [], 1)]
    assert new_plans(out) == [("b", [0, 1, 3], 8, 2), ("c", [0, 4], 4, 4)]
    assert [s.kv.pool.blocks[i].ref_cnt for i in range(5)] == [3, 2, 1, 1, 1]
    assert (s.kv.prefix_queries, s.kv.prefix_hits) == (11 + 10 + 8, 8 + 4)
    assert s.requests["b"].num_cached_tokens == 8 and s.requests["c"].num_cached_tokens == 4

    outputs = d.run()
    assert outputs["b"] == generate(SYSTEM + [30, 31], 16, VOCAB)
    assert s.kv.pool.num_used_blocks == 0 and s.kv.held_request_ids() == []
    # Partial (uncached) blocks were freed to the head; cached prefixes wait at the tail, least recent first.
    queue = s.kv.pool.free_queue.block_ids()
    assert set(queue) == set(range(16)) and queue[-1] == 0


def test_a_long_prompt_is_prefilled_in_chunks_after_running_decodes():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    d = Driver(s)
    s.add_request(make_request("short", [9, 9, 9]))
    out, results = d.step()
    assert new_plans(out) == [("short", [0], 0, 3)] and len(results) == 1

    s.add_request(make_request("long", list(range(100, 120))))  # 20 tokens
    out, results = d.step()
    assert running_plans(out) == [("short", [], 1)]  # running first; position 3 is still in block 0
    assert new_plans(out) == [("long", [1, 2], 0, 7)]  # the rest of the budget
    assert [r.request.request_id for r in results] == ["short"]  # a partial prefill samples nothing
    out, results = d.step()
    assert running_plans(out) == [("short", [3], 1), ("long", [4, 5], 7)]
    out, results = d.step()
    assert running_plans(out) == [("short", [], 1), ("long", [6], 6)]
    assert [r.request.request_id for r in results] == ["short", "long"]  # the prompt is done: first token
    assert out.total_num_scheduled_tokens == 7
    assert d.run()["long"] == generate(list(range(100, 120)), 16, VOCAB)


def test_fcfs_preempts_the_latest_admitted_and_resumes_it_with_the_same_tokens():
    s = make_scheduler(num_blocks=4, block_size=2)
    d = Driver(s)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=4))
    s.add_request(make_request("b", [4, 5, 6], max_tokens=4))
    out, _ = d.step()
    assert new_plans(out) == [("a", [0, 1], 0, 3), ("b", [2, 3], 0, 3)]
    out, _ = d.step()  # position 3 still fits in each second block
    assert running_plans(out) == [("a", [], 1), ("b", [], 1)]

    out, _ = d.step()  # a needs a third block: b (admitted last) is preempted, its blocks freed tail first
    assert out.preempted_ids == ["b"] and out.finished_ids == ["b"]
    assert running_plans(out) == [("a", [3], 1)]  # b's tail block, evicted from the cache
    assert out.new_requests == []
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and s.num_preemptions == 1
    assert s.kv.pool.free_queue.block_ids() == [2]

    outputs = d.run()
    assert outputs["a"] == generate([1, 2, 3], 4, VOCAB)
    assert outputs["b"] == generate([4, 5, 6], 4, VOCAB)
    assert s.kv.pool.num_used_blocks == 0


def test_a_resumed_request_is_sent_in_full_with_its_outputs():
    s = make_scheduler(num_blocks=4, block_size=2)
    d = Driver(s)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=3))
    s.add_request(make_request("b", [4, 5, 6], max_tokens=8))
    for _ in range(3):
        out, _ = d.step()
    assert out.preempted_ids == ["b"]
    b = s.requests["b"]
    known = list(b.all_token_ids)
    assert len(known) == 5  # prompt + two outputs, the last without K/V
    while True:
        out, _ = d.step()
        if out.new_requests:
            break
    (plan,) = out.new_requests
    assert plan.request is b and plan.request.all_token_ids[:5] == known and b.num_prompt_tokens == 3
    assert plan.num_computed_tokens == 2  # b's first block survived in the prefix cache
    # The pool holds 8 tokens: b stops there ("length") rather than outgrow what could ever be recomputed.
    assert d.run()["b"] == generate([4, 5, 6], 5, VOCAB)


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2, policy="priority")
    d = Driver(s)
    s.add_request(make_request("low", [1, 2, 3], priority=5))
    s.add_request(make_request("high", [4, 5, 6], priority=0))
    s.add_request(make_request("mid", [7, 8, 9], priority=1))
    out, _ = d.step()
    assert [p[0] for p in new_plans(out)] == ["high", "mid"]  # cap of two sequences
    out, _ = d.step()
    out, _ = d.step()  # high needs a block: the lowest priority running request (mid) goes, though it is last
    assert out.preempted_ids == ["mid"]
    assert [r.request_id for r in s.waiting] == ["mid", "low"]


def test_priority_preemption_of_an_already_scheduled_request_gives_its_budget_back():
    s = make_scheduler(num_blocks=6, block_size=2, policy="priority")
    d = Driver(s)
    s.add_request(make_request("late-low", [1, 2, 3], priority=9))
    d.step()
    s.add_request(make_request("high", [4, 5, 6, 7, 8], priority=0))
    out, _ = d.step()
    assert new_plans(out) == [("high", [2, 3, 4], 0, 5)]
    out, _ = d.step()
    assert running_plans(out) == [("late-low", [5], 1), ("high", [], 1)]
    # late-low (first in line) fits; then high needs a block, and late-low, already planned, is taken back.
    out, _ = d.step()
    assert out.preempted_ids == ["late-low"] and running_plans(out) == [("high", [5], 1)]
    assert out.total_num_scheduled_tokens == 1
    assert s.kv.pool.free_queue.block_ids() == [1, 0]  # late-low's full blocks, cached
    outputs = d.run()
    assert outputs["late-low"] == generate([1, 2, 3], 16, VOCAB)[: len(outputs["late-low"])]
    assert s.kv.pool.num_used_blocks == 0


def test_stop_conditions_on_token_ids():
    s = make_scheduler(num_blocks=32, block_size=4, eos=(7,), max_model_len=12)
    d = Driver(s)
    s.add_request(make_request("eos", [1]))
    s.add_request(make_request("ignore", [1], ignore_eos=True))
    s.add_request(make_request("stop-id", [1], stop_token_ids=frozenset({42})))
    s.add_request(make_request("min", [1], min_tokens=2))
    s.add_request(make_request("max", [1], max_tokens=2))
    s.add_request(make_request("model-len", [1] * 10, ignore_eos=True))
    out = s.schedule()
    results = d.answer(out, {"eos": 7, "ignore": 7, "stop-id": 42, "min": 7, "max": 7})
    finish = {r.request.request_id: r.finish for r in results}
    assert finish == {
        "eos": RequestStatus.FINISHED_STOPPED,
        "ignore": None,
        "stop-id": RequestStatus.FINISHED_STOPPED,
        "min": None,  # min_tokens not reached yet
        "max": RequestStatus.FINISHED_STOPPED,  # EOS with max_tokens left
        "model-len": None,  # 11 tokens of 12
    }
    assert out.finished_ids == []
    out = s.schedule()
    assert sorted(out.finished_ids) == ["eos", "max", "stop-id"]  # the worker drops them next step
    results = d.answer(out, {"min": 7, "max": 7})
    finish = {r.request.request_id: r.finish for r in results}
    assert finish["min"] is RequestStatus.FINISHED_STOPPED  # the EOS is part of the output
    assert finish["model-len"] is RequestStatus.FINISHED_LENGTH
    assert s.requests.keys() == {"ignore"}
    assert d.run()["ignore"][-1] is not None and s.kv.pool.num_used_blocks == 0


@pytest.mark.parametrize("state", ["waiting", "running", "preempted", "mid-step"])
def test_abort_in_any_state_frees_every_block(state):
    s = make_scheduler(num_blocks=4, block_size=2)
    d = Driver(s)
    s.add_request(make_request("a", [1, 2, 3], max_tokens=50))
    s.add_request(make_request("b", [4, 5, 6], max_tokens=50))
    if state != "waiting":
        d.step()
    if state == "preempted":
        d.step()
        d.step()
        assert s.requests["b"].status is RequestStatus.PREEMPTED
    if state == "mid-step":
        out = s.schedule()
    aborted = s.abort_request("b")
    assert aborted.status is RequestStatus.FINISHED_ABORTED
    assert "b" not in s.kv.held_request_ids() and s.abort_request("b") is None
    if state == "mid-step":
        d.answer(out)  # the result for b is ignored
    next_out = s.schedule()
    assert ("b" in next_out.finished_ids) == (state in ("running", "mid-step"))
    d.answer(next_out)
    s.abort_request("a")
    assert s.kv.pool.num_used_blocks == 0 and s.kv.pool.usage == 0
    assert s.num_running == 0 and s.num_waiting == 0
    assert s.schedule().finished_ids == ["a"]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=2)
    d = Driver(s)
    for i in range(3):
        s.add_request(make_request(f"r{i}", [i + 1], max_tokens=2))
    out, _ = d.step()
    assert [p[0] for p in new_plans(out)] == ["r0", "r1"] and s.num_waiting == 1
    out, _ = d.step()
    assert out.new_requests == []
    out, _ = d.step()  # r0 and r1 finished last step
    assert [p[0] for p in new_plans(out)] == ["r2"] and sorted(out.finished_ids) == ["r0", "r1"]


def test_a_missing_sample_is_a_protocol_error():
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add_request(make_request("a", [1, 2]))
    out = s.schedule()
    with pytest.raises(WorkerProtocolError):
        s.update_from_output(out, [])
    s2 = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=2)
    s2.add_request(make_request("a", [1, 2, 3]))
    out = s2.schedule()  # a partial prefill must not sample
    with pytest.raises(WorkerProtocolError):
        s2.update_from_output(out, [("a", 5, None)])


def test_a_lost_worker_s_requests_resume_on_a_fresh_smaller_pool_with_the_same_tokens():
    old = make_scheduler(num_blocks=16, block_size=4, max_model_len=40)
    d = Driver(old)
    old.add_request(make_request("a", [1, 2, 3], max_tokens=12))
    old.add_request(make_request("b", [4, 5, 6, 7, 8], max_tokens=12))
    for _ in range(4):
        d.step()
    old.add_request(make_request("c", [9, 9], max_tokens=3))  # still waiting when the worker dies
    old.add_request(make_request("long", [1] * 17, max_tokens=4))
    old.waiting.remove(old.requests["long"])  # keep it waiting behind "c" in the same queue order
    old.waiting.add(old.requests["long"])
    before = {rid: list(old.requests[rid].all_token_ids) for rid in ("a", "b")}
    assert all(len(tokens) > 5 for tokens in before.values())  # both streamed outputs before the loss

    moved = old.evacuate()
    assert [r.request_id for r in moved] == ["a", "b", "c", "long"]  # running in admission order, then waiting
    assert old.kv.pool.num_used_blocks == 0 and not old.has_work() and old.requests == {}
    assert all(r.num_computed_tokens == 0 and not r.on_worker and r.status is RequestStatus.PREEMPTED for r in moved)
    assert {r.request_id: r.all_token_ids for r in moved[:2]} == before

    # The new worker's pool holds 16 tokens: "long" (17 prompt tokens) could never be computed there.
    new = make_scheduler(num_blocks=4, block_size=4, max_model_len=40)
    rejected = new.adopt(moved)
    assert [r.request_id for r in rejected] == ["long"] and "long" not in new.requests
    new.add_request(make_request("later", [2, 2], max_tokens=2))
    first = new.schedule()
    # Resumed requests go first, in full (the fresh worker holds nothing), computed again from position 0.
    assert first.new_requests[0].request.request_id == "a" and first.new_requests[0].num_computed_tokens == 0
    assert first.new_requests[0].request.all_token_ids == before["a"]
    d2 = Driver(new)
    d2.answer(first)
    outputs = d2.run()
    for rid, prompt, max_tokens in (("a", [1, 2, 3], 12), ("b", [4, 5, 6, 7, 8], 12), ("c", [9, 9], 3)):
        # Never more than the new pool holds: a request reaching 16 tokens ends with "length".
        limit = min(max_tokens, new.max_seq_len - len(prompt))
        assert d.outputs.get(rid, []) + outputs[rid] == generate(prompt, limit, VOCAB), rid
    assert outputs["later"] == generate([2, 2], 2, VOCAB)
    assert new.kv.pool.num_used_blocks == 0 and new.requests == {}
