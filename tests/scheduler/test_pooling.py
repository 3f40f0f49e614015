"""Pooling requests in the pure scheduler: prefill only (chunked like any prompt), ended by the worker's vector
with their blocks freed in that same step, never decoded; mean and cls pooling skip the prefix cache."""

from __future__ import annotations

import pytest

from kvgrid.v1 import common_pb2
from services.scheduler.request import Request, RequestStatus, StopConditions
from services.scheduler.scheduler import WorkerProtocolError
from tests.scheduler.core import make_request, make_scheduler


def pooling_request(request_id: str, prompt: list[int], pooling_type: str = "last") -> Request:
    params = common_pb2.PoolingParams(pooling_type=pooling_type, normalize=True)
    return Request(
        request_id,
        prompt,
        StopConditions(max_tokens=1),
        pooling=params,
        skip_prefix_cache=pooling_type != "last",
    )


def scheduled(out) -> dict[str, int]:
    plans = [*out.new_requests, *out.running]
    return {p.request.request_id: p.num_scheduled_tokens for p in plans}


def test_a_pooling_prompt_is_prefilled_in_chunks_and_ends_with_its_vector():
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=4)
    s.add_request(pooling_request("p", list(range(1, 11))))
    for chunk in (4, 4):
        out = s.schedule()
        assert scheduled(out) == {"p": chunk} and not [p for p in out.new_requests + out.running if p.samples]
        assert s.update_from_output(out, [], pooled={}) == []
    out = s.schedule()
    assert scheduled(out) == {"p": 2} and out.running[0].samples
    assert s.kv.pool.num_used_blocks == 3
    (result,) = s.update_from_output(out, [], pooled={"p": [0.5, -0.5]})
    assert (result.pooled, result.finish) == ([0.5, -0.5], RequestStatus.FINISHED_STOPPED)
    # Freed in the step that computed the prompt's last token; the worker drops it with the next plan.
    assert s.kv.pool.num_used_blocks == 0 and s.requests == {} and s.running == []
    assert s.schedule().finished_ids == ["p"]
    assert not s.has_work()


def test_pooling_and_generation_share_steps_and_only_generation_decodes():
    s = make_scheduler(num_blocks=16, block_size=4)
    s.add_request(make_request("g", [1, 2, 3], max_tokens=3))
    s.add_request(pooling_request("p", [4, 5, 6, 7, 8]))
    out = s.schedule()
    assert scheduled(out) == {"g": 3, "p": 5}
    results = s.update_from_output(out, [("g", 9, None)], pooled={"p": [1.0]})
    assert [(r.request.request_id, r.token_id if r.pooled is None else r.pooled) for r in results] == [
        ("g", 9),
        ("p", [1.0]),
    ]
    out = s.schedule()
    assert scheduled(out) == {"g": 1} and out.finished_ids == ["p"]


def test_a_missing_vector_breaks_the_protocol():
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add_request(pooling_request("p", [1, 2, 3]))
    out = s.schedule()
    with pytest.raises(WorkerProtocolError, match="no pooled vector for 'p'"):
        s.update_from_output(out, [], pooled={})


def test_mean_and_cls_pooling_compute_every_token_last_pooling_reuses_the_cache():
    s = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 10))
    s.add_request(make_request("warm", prompt, max_tokens=1))
    out = s.schedule()
    s.update_from_output(out, [("warm", 50, None)])
    for request in (pooling_request("mean", prompt, "mean"), pooling_request("cls", prompt, "cls")):
        s.add_request(request)
    s.add_request(pooling_request("last", prompt, "last"))
    out = s.schedule()
    computed = {p.request.request_id: p.num_computed_tokens for p in out.new_requests}
    assert computed == {"mean": 0, "cls": 0, "last": 8}


def test_async_scheduling_never_plans_past_a_pooling_prompt():
    s = make_scheduler(num_blocks=8, block_size=4)
    s.add_request(pooling_request("p", [1, 2, 3]))
    first = s.schedule()
    second = s.schedule()  # planned before the first result is back: nothing more to compute for "p"
    assert scheduled(first) == {"p": 3} and scheduled(second) == {}
    (result,) = s.update_from_output(first, [], pooled={"p": [2.0]})
    assert result.pooled == [2.0]
    assert s.update_from_output(second, [], pooled={}) == []


def test_admission_matches_requests_to_the_runner():
    from kvgrid.v1 import scheduler_pb2
    from services.common.errors import InvalidArgument
    from services.scheduler.admission import AdmissionLimits, admit

    def limits(pooling: bool) -> AdmissionLimits:
        return AdmissionLimits(64, 16, 4, 100, 10, pooling=pooling)

    resolved = common_pb2.PoolingParams(pooling_type="mean", normalize=True)
    request = admit(scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2], pooling=resolved), limits(True), (), 0)
    assert request.pooling == resolved and request.skip_prefix_cache and request.stop.max_tokens == 1
    with pytest.raises(InvalidArgument, match="--runner pooling"):
        admit(scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2]), limits(True), (), 0)
    with pytest.raises(InvalidArgument, match="--runner generate"):
        admit(scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2], pooling=resolved), limits(False), (), 0)
    unresolved = common_pb2.PoolingParams(dimensions=4)
    with pytest.raises(InvalidArgument, match="pooling_type and normalize must be set"):
        admit(scheduler_pb2.SubmitRequest(prompt_token_ids=[1, 2], pooling=unresolved), limits(True), (), 0)


def test_a_preempted_pooling_request_is_computed_again_from_its_first_token():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=4)
    s.add_request(make_request("g", [1, 2, 3, 4], max_tokens=8))
    out = s.schedule()
    s.update_from_output(out, [("g", 9, None)])
    s.add_request(pooling_request("p", list(range(10, 25)), "mean"))  # 15 tokens: 4 blocks, more than g leaves
    preempted = []
    while not preempted:  # g decodes, p is prefilled in chunks until the pool runs dry: p (admitted last) yields
        out = s.schedule()
        assert not [p for p in [*out.new_requests, *out.running] if p.samples and p.request.request_id == "p"]
        preempted = out.preempted_ids
        s.update_from_output(out, [("g", 9, None)], pooled={})
    assert preempted == ["p"] and s.requests["p"].status is RequestStatus.PREEMPTED
    s.abort_request("g")
    vectors = {}
    while s.has_work():
        out = s.schedule()
        for plan in out.new_requests:
            assert (plan.request.request_id, plan.num_computed_tokens) == ("p", 0)
        done = [p.request.request_id for p in [*out.new_requests, *out.running] if p.samples]
        for result in s.update_from_output(out, [], pooled={rid: [3.0] for rid in done}):
            vectors[result.request.request_id] = result.pooled
    assert vectors == {"p": [3.0]} and s.kv.pool.num_used_blocks == 0


def test_mean_pooling_loads_nothing_from_the_kv_tiers():
    from tests.scheduler.core import Driver
    from tests.scheduler.test_kv_tiers import BS, with_tiers

    s = make_scheduler(num_blocks=16, block_size=BS)
    driver = Driver(s)
    tiers = with_tiers(s, driver.model, redis=True)
    prompt = list(range(10, 23))
    s.add_request(make_request("a", prompt, max_tokens=4))
    driver.run()  # its blocks are written through to the Redis tier
    other = make_scheduler(num_blocks=16, block_size=BS)
    with_tiers(other, Driver(other).model, redis=True).redis.client = tiers.redis.client
    other.add_request(pooling_request("m", prompt, "mean"))
    other.add_request(pooling_request("l", prompt, "last"))
    out = other.schedule()
    loads = {new.request.request_id: (len(new.kv_loads), new.num_computed_tokens) for new in out.new_requests}
    assert loads == {"m": (0, 0), "l": (3, 12)}
