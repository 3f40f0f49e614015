"""Pooling requests in the worker's request states: which runner takes which request, resolved params only; and
the pooled state kept across a prompt's chunks equal to pooling the whole prompt at once."""

from __future__ import annotations

import pytest
import torch

from kvgrid.v1 import common_pb2, worker_pb2
from services.common.errors import InvalidArgument
from services.worker.pooling import PoolingState
from services.worker.request_state import RequestStates
from services.worker.sampling.request_sampling import RequestSampling


def states(pooling: bool) -> RequestStates:
    return RequestStates(
        block_size=4,
        num_blocks=10,
        vocab_size=100,
        max_model_len=32,
        make_sampling=lambda params, prompt, outputs: RequestSampling.create(params, prompt, outputs),
        pooling=pooling,
    )


def new(rid: str, pooling: common_pb2.PoolingParams | None, computed: int = 0) -> worker_pb2.NewRequest:
    tokens = [1, 2, 3, 4, 5, 6]
    return worker_pb2.NewRequest(
        request_id=rid,
        token_ids=tokens,
        num_prompt_tokens=len(tokens),
        block_ids=[0, 1],
        num_computed_tokens=computed,
        num_scheduled_tokens=len(tokens) - computed,
        pooling=pooling,
    )


MEAN = common_pb2.PoolingParams(pooling_type="mean", normalize=False)


def test_each_runner_takes_its_own_requests_only():
    (state,) = states(True).apply(worker_pb2.StepPlan(new_requests=[new("p", MEAN)]))
    assert state.pooling == PoolingState("mean", False, 0)
    with pytest.raises(InvalidArgument, match="--runner pooling"):
        states(True).apply(worker_pb2.StepPlan(new_requests=[new("g", None)]))
    with pytest.raises(InvalidArgument, match="--runner generate"):
        states(False).apply(worker_pb2.StepPlan(new_requests=[new("p", MEAN)]))


@pytest.mark.parametrize(
    "params,computed,words",
    [
        (common_pb2.PoolingParams(pooling_type="mean"), 0, "normalize must be set"),
        (common_pb2.PoolingParams(normalize=True), 0, "pooling_type"),
        (common_pb2.PoolingParams(pooling_type="max", normalize=True), 0, "must be one of"),
        (MEAN, 4, "needs every prompt token computed"),
    ],
)
def test_unresolved_or_impossible_params_are_refused(params, computed, words):
    s = states(True)
    with pytest.raises(InvalidArgument, match=words):
        s.apply(worker_pb2.StepPlan(new_requests=[new("p", params, computed)]))
    assert s.requests == {}


@pytest.mark.parametrize("pooling_type", ["last", "mean", "cls"])
def test_chunks_pool_as_the_whole_prompt(pooling_type):
    torch.manual_seed(0)
    hidden = torch.randn(11, 8)
    whole = PoolingState(pooling_type, True, 5)
    whole.add(hidden, 0)
    chunked = PoolingState(pooling_type, True, 5)
    for start, end in [(0, 4), (4, 5), (5, 11)]:
        chunked.add(hidden[start:end], start)
    expected = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[pooling_type][:5]
    for state in (whole, chunked):
        torch.testing.assert_close(state.finish(hidden[5:], 11), torch.nn.functional.normalize(expected, dim=0))
