"""The runner scores prompt tokens from the positions each step computes: chunk by chunk, skipping those the
scheduler already has, next to a request that does not ask (which pays for no extra logits)."""

from __future__ import annotations

import pytest
import torch

from kvgrid.v1 import common_pb2, worker_pb2
from services.worker.request_state import RequestStates
from services.worker.sampling import prompt_logprobs
from services.worker.sampling.request_sampling import RequestSampling
from services.worker.setup.build import create_runner, load_model
from tests.worker.tiny import hf_model, save_tiny_model

BLOCK = 4


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def new_request(rid, prompt, blocks, scheduled, done=0, k=None) -> worker_pb2.NewRequest:
    sampling = common_pb2.SamplingParams()
    if k is not None:
        sampling.prompt_logprobs = k
    return worker_pb2.NewRequest(
        request_id=rid,
        token_ids=prompt,
        num_prompt_tokens=len(prompt),
        sampling=sampling,
        block_ids=blocks,
        num_scheduled_tokens=scheduled,
        num_prompt_logprobs_done=done,
    )


def test_chunks_score_each_remaining_prompt_position_once(model_path):
    runner = create_runner(load_model(model_path, dtype="float32", device="cpu"), BLOCK, 16)
    states = RequestStates(BLOCK, 16, 160, 256, lambda p, prompt, out: RequestSampling.create(p, prompt, out))
    prompt = [(7 * i) % 150 + 3 for i in range(13)]
    other = [5, 6, 7, 8, 9]
    plans = [  # "a" was preempted with positions 1..4 scored: it recomputes from 0, in chunks of 6 and 7
        worker_pb2.StepPlan(
            step_id=1,
            new_requests=[new_request("a", prompt, [0, 1, 2, 3], 6, done=4, k=2), new_request("b", other, [4, 5], 5)],
        ),
        worker_pb2.StepPlan(step_id=2, running=[worker_pb2.RunningRequest(request_id="a", num_scheduled_tokens=7)]),
    ]
    chunks = []
    for plan in plans:
        scheduled = states.apply(plan)
        inputs = runner.prepare(scheduled)
        if plan.step_id == 1:
            assert inputs.prompt_rows.rows == [4, 5]  # a's positions 4, 5 score tokens 5, 6; b asks nothing
        runner.execute(scheduled)
        chunks += prompt_logprobs.take(scheduled)
        assert prompt_logprobs.take(scheduled) == []  # handed over once
    # Tokens 5, 6 from the first chunk (positions 0..5), 7..12 from the second (the last position scores nothing).
    assert [(c.request_id, c.start, len(c.logprobs)) for c in chunks] == [("a", 5, 2), ("a", 7, 6)]
    entries = [e for c in chunks for e in c.logprobs]
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(model_path)(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for position, entry in enumerate(entries, start=5):
        row = ref[position - 1]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - row[prompt[position]].item()) < 1e-4
        assert [t.token_id for t in entry.top] == row.topk(2).indices.tolist()
