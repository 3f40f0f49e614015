"""The worker's side of lookahead: plans are checked, proposals come from the request's own tokens."""

from __future__ import annotations

import pytest

from kvgrid.v1 import worker_pb2
from services.common.errors import InvalidArgument
from services.worker.spec_decode.ngram import propose_ngram
from tests.worker.test_state import new, states


def running(rid: str, lookahead: int, scheduled: int = 1, blocks=()) -> worker_pb2.StepPlan:
    entry = worker_pb2.RunningRequest(
        request_id=rid, num_scheduled_tokens=scheduled, num_lookahead_tokens=lookahead, new_block_ids=list(blocks)
    )
    return worker_pb2.StepPlan(running=[entry])


def decoding_state():
    s = states()  # blocks of 4, 10 blocks, max_model_len 32
    (a,) = s.apply(worker_pb2.StepPlan(new_requests=[new("a", [1, 2, 3, 4, 5], [7, 2])]))
    a.num_computed_tokens, a.token_ids = 5, a.token_ids + [9]  # 6 known, 5 computed: a decode
    return s, a


def test_lookahead_slots_reach_the_request():
    s, a = decoding_state()
    s.apply(running("a", 2))  # positions 5..7: the two blocks hold 8
    assert a.num_lookahead_tokens == 2
    s.apply(running("a", 0))
    assert a.num_lookahead_tokens == 0


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (running("a", 3), "blocks"),  # position 8 has no slot
    ],
)
def test_a_bad_lookahead_is_refused_and_changes_nothing(plan, message):
    s, a = decoding_state()
    with pytest.raises(InvalidArgument, match=message):
        s.apply(plan)
    assert a.num_lookahead_tokens == 0 and a.block_ids == [7, 2]


def test_only_a_decode_carries_proposals():
    s = states()
    (b,) = s.apply(worker_pb2.StepPlan(new_requests=[new("b", [1, 2, 3, 4, 5], [7, 2], scheduled=2)]))
    b.num_computed_tokens = 2  # a prompt chunk is left
    with pytest.raises(InvalidArgument, match="lookahead needs a decode"):
        s.apply(running("b", 1, scheduled=2))


def test_lookahead_past_max_model_len_is_refused():
    s, _ = decoding_state()
    with pytest.raises(InvalidArgument, match="max_model_len"):
        s.apply(running("a", 27, blocks=[0, 1, 3, 4, 5, 6]))


def test_ngram_proposals_follow_the_latest_earlier_occurrence_of_the_longest_tail():
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [4, 9]  # [1, 2, 3] occurs at 0
    assert propose_ngram(tokens, 2, 1, 2) == [5, 6]  # [2, 3]: the latest is at 5
    assert propose_ngram(tokens, 2, 4, 4) == []  # [3, 1, 2, 3]... no earlier 4-gram
    assert propose_ngram([7, 7], 3, 1, 1) == [7]  # only one token follows the match
    assert propose_ngram([256, 1, 0, 0, 1], 2, 1, 1) == [0, 0]  # byte patterns that straddle tokens never match


def test_spec_decode_metrics_have_vllms_meaning():
    from prometheus_client import generate_latest

    from services.worker.metrics import WorkerMetrics

    metrics = WorkerMetrics("m")
    record = metrics.spec_decode_recorder("ngram")
    record(3, 2)  # 3 proposed, the first 2 accepted
    record(2, 0)
    text = generate_latest(metrics.registry).decode()
    labels = 'method="ngram",model="m"'
    assert f"kvgrid_spec_decode_num_drafts_total{{{labels}}} 2.0" in text
    assert f"kvgrid_spec_decode_num_draft_tokens_total{{{labels}}} 5.0" in text
    assert f"kvgrid_spec_decode_num_accepted_tokens_total{{{labels}}} 2.0" in text
    per_pos = "kvgrid_spec_decode_num_accepted_tokens_per_pos_total"
    assert f'{per_pos}{{method="ngram",model="m",position="0"}} 1.0' in text
    assert f'{per_pos}{{method="ngram",model="m",position="1"}} 1.0' in text


def test_backoff_pauses_a_request_whose_proposals_are_mostly_rejected():
    from services.worker.spec_decode.decoder import MIN_ACCEPTANCE, PAUSE_STEPS, WINDOW, Backoff

    good, bad = Backoff(), Backoff()
    for _ in range(WINDOW):
        assert good.allows() and bad.allows()
        good.record(1, 1)
        bad.record(1, 0)
    assert good.allows()
    assert [bad.allows() for _ in range(PAUSE_STEPS)] == [False] * PAUSE_STEPS
    assert bad.allows()  # then it tries again with a fresh window
    borderline = Backoff()
    borderline.record(WINDOW, int(MIN_ACCEPTANCE * WINDOW) + 1)
    assert borderline.allows()
