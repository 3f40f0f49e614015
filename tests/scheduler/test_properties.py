"""Random add / schedule / sample / abort / finish sequences; the bookkeeping invariants hold after every step."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.scheduler.convert import plan_to_proto, sampled_from_proto
from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import Scheduler
from tests.scheduler.core import VOCAB, Driver, make_request, make_scheduler
from tests.scheduler.fake_worker import next_token

EOS = VOCAB - 1
PREFIXES = [[], [11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 14, 21, 22]]


def check_invariants(s: Scheduler) -> None:
    pool, kv = s.kv.pool, s.kv
    holders: Counter[int] = Counter()
    for request_id in kv.held_request_ids():
        assert request_id in s.requests, f"{request_id} is gone but holds blocks"
        table = kv.blocks_of(request_id)
        block_ids = [b.block_id for b in table]
        assert len(set(block_ids)) == len(block_ids), "a block twice in one table"
        assert len(table) * kv.block_size >= s.requests[request_id].num_computed_tokens
        holders.update(block_ids)
    free = pool.free_queue.block_ids()
    assert len(free) == len(set(free)) == pool.num_free_blocks
    free_set = set(free)
    for block in pool.blocks:
        assert block.ref_cnt == holders[block.block_id], f"block {block.block_id}: ref_cnt != holders"
        assert (block.block_id in free_set) == (block.ref_cnt == 0)
        if block.ref_cnt > 1:
            assert block.block_hash is not None, f"block {block.block_id} shared but not a cached prefix"
        if block.block_hash is not None:
            assert pool.get_cached_block(block.block_hash) is block
    assert pool.num_used_blocks == len(holders)
    running = set(id(r) for r in s.running)
    waiting = set(id(r) for r in s.waiting)
    assert len(running) == len(s.running) <= s.limits.max_num_seqs and not running & waiting
    for request in s.requests.values():
        if request.status is RequestStatus.RUNNING:
            assert id(request) in running
        else:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert id(request) in waiting and not kv.blocks_of(request.request_id)
    assert len(running) + len(waiting) == len(s.requests)


def check_tokens(prompt: list[int], outputs: list[int], forced: set[int]) -> None:
    """Every output token is the fake model's next token, except a forced EOS, which ends the request."""
    tokens = list(prompt)
    for i, token in enumerate(outputs):
        if i in forced:
            assert token == EOS and i == len(outputs) - 1, f"token {i} after a forced EOS"
        else:
            assert token == next_token(tokens, VOCAB), f"token {i}: {token} is not the model's"
        tokens.append(token)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_operation_sequences_keep_the_invariants(data):
    block_size = data.draw(st.sampled_from([1, 2, 4]), "block_size")
    num_blocks = data.draw(st.integers(4, 24), "num_blocks")
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=data.draw(st.integers(1, 6), "max_num_seqs"),
        max_num_batched_tokens=data.draw(st.integers(1, 24), "budget"),
        max_model_len=data.draw(st.integers(8, 64), "max_model_len"),
        policy=data.draw(st.sampled_from(["fcfs", "priority"]), "policy"),
        eos=(EOS,),
        caching=data.draw(st.booleans(), "caching"),
    )
    d = Driver(s)
    prompts: dict[str, list[int]] = {}
    ignores_eos: dict[str, bool] = {}
    forced: dict[str, set[int]] = {}
    aborted: set[str] = set()
    pending = None
    longest = min(s.max_seq_len, num_blocks * block_size) - 1  # what admission lets through
    ops = data.draw(
        st.lists(st.sampled_from(["add", "add", "schedule", "sample", "sample", "abort", "finish"]), max_size=60),
        "ops",
    )
    for n, op in enumerate(ops):
        if op == "add":
            prefix = data.draw(st.sampled_from(PREFIXES))
            suffix = data.draw(st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=10))
            prompt = (prefix + suffix)[-longest:]
            request_id = f"r{n}"
            prompts[request_id] = prompt
            ignores_eos[request_id] = data.draw(st.booleans())
            s.add_request(
                make_request(
                    request_id,
                    prompt,
                    max_tokens=data.draw(st.integers(1, 12)),
                    priority=data.draw(st.integers(0, 2)),
                    ignore_eos=ignores_eos[request_id],
                )
            )
        elif op == "schedule" and pending is None:
            pending = s.schedule()
        elif op in ("sample", "finish") and pending is not None:
            sampled = sampled_from_proto(d.model.step(plan_to_proto(pending)))
            # Force an EOS on a request that stops on it (the fake model's state diverges, but it drops the request).
            stoppable = [k for k, (rid, _, _) in enumerate(sampled) if rid in s.requests and not ignores_eos[rid]]
            if op == "finish" and stoppable:
                k = data.draw(st.sampled_from(stoppable))
                request_id = sampled[k][0]
                forced.setdefault(request_id, set()).add(len(d.outputs.get(request_id, [])))
                sampled[k] = (request_id, EOS, None)
            for r in s.update_from_output(pending, sampled):
                d.outputs.setdefault(r.request.request_id, []).append(r.token_id)
            pending = None
        elif op == "abort" and s.requests:
            request_id = data.draw(st.sampled_from(sorted(s.requests)))
            assert s.abort_request(request_id).status is RequestStatus.FINISHED_ABORTED
            aborted.add(request_id)
        check_invariants(s)

    if pending is not None:
        for r in s.update_from_output(pending, sampled_from_proto(d.model.step(plan_to_proto(pending)))):
            d.outputs.setdefault(r.request.request_id, []).append(r.token_id)
    outputs = d.run()  # everything left finishes: nothing is stuck
    check_invariants(s)
    assert s.requests == {} and s.kv.held_request_ids() == []
    assert s.kv.pool.num_used_blocks == 0 and s.kv.pool.usage == 0
    for request_id, prompt in prompts.items():
        check_tokens(prompt, outputs.get(request_id, []), forced.get(request_id, set()))
        if request_id not in aborted:
            assert outputs.get(request_id), f"{request_id} finished without output"
