"""Stop strings, applied by the frontend over real gRPC in front of a fake scheduler that plays scripted tokens:
excluded from the text wherever they fall, held back while ambiguous, and ending the request upstream."""

from __future__ import annotations

import pytest

from kvgrid.v1 import common_pb2
from tests.tokenizer.conftest import generate, joined, wait_until
from tests.tokenizer.fake_scheduler import Script

pytestmark = pytest.mark.timeout(120)
LENGTH = common_pb2.FINISH_REASON_LENGTH


def test_stop_string_across_tokens_is_excluded_and_aborts_upstream(stack, smollm):
    text = "Hello world! The END of it, more text"
    ids = smollm.hf(text, add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], hang=True)  # the scheduler would go on forever
    sampling = common_pb2.SamplingParams(max_tokens=50, stop=["END", "zzz"])
    responses = generate(stack, prompt="hi", request_id="stop-1", sampling=sampling)
    assert joined(responses)[0] == "Hello world! The "
    assert responses[-1].finish_reason == "stop"
    assert responses[-1].usage.completion_tokens == len(joined(responses)[1])
    assert len(stack.fake.submits[-1].sampling.stop) == 0  # applied here, not by the scheduler
    wait_until(lambda: "stop-1" in stack.fake.aborts, what="Abort at the scheduler")
    wait_until(lambda: "stop-1" in stack.fake.cancelled, what="the scheduler to stop the request")


def test_a_request_id_ended_by_a_stop_string_can_be_reused_at_once(stack, smollm):
    # The abort travels on the one stream ahead of the next submit, so even a slow abort never refuses (or hits)
    # a request that reuses the id as soon as the client saw the end.
    ids = smollm.hf("one END two", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], hang=True)
    stack.fake.abort_delay_s = 0.3
    try:
        sampling = common_pb2.SamplingParams(stop=["END"])
        first = generate(stack, prompt="hi", request_id="stop-reuse", sampling=sampling)
        stack.fake.script = Script(deltas=[[ids[0]]], finish=LENGTH)
        again = generate(stack, prompt="hi", request_id="stop-reuse", sampling=sampling)
        assert first[-1].finish_reason == "stop" and again[-1].finish_reason == "length"
        events = [e for e in stack.fake.events if e[1] == "stop-reuse"]
        assert events == [("submit", "stop-reuse"), ("abort", "stop-reuse"), ("submit", "stop-reuse")]
    finally:
        stack.fake.abort_delay_s = 0.0


def test_stop_string_prefix_is_held_back_until_disambiguated(stack, smollm):
    # "ST" could start "STOP": held back; "STAR" shows it does not, so it is released.
    pieces = ["Go", " ST", "AR", " now"]
    deltas = [smollm.hf(p, add_special_tokens=False)["input_ids"] for p in pieces]
    stack.fake.script = Script(deltas=deltas, finish=LENGTH)
    responses = generate(stack, prompt="hi", sampling=common_pb2.SamplingParams(stop=["STOP"]))
    texts = [r.text for r in responses if r.token_ids]
    assert texts == ["Go", " ", "STAR", " now"]
    assert responses[-1].finish_reason == "length"


def test_stop_string_at_the_very_end_is_still_excluded(stack, smollm):
    ids = smollm.hf("answer: 42\n\n", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[ids], finish=LENGTH)
    responses = generate(stack, prompt="q", sampling=common_pb2.SamplingParams(stop=["\n\n"]))
    assert joined(responses)[0] == "answer: 42" and responses[-1].finish_reason == "stop"


def test_stop_strings_apply_only_after_min_tokens(stack, smollm):
    ids = smollm.hf("a. b. c. d.", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], finish=LENGTH)
    sampling = common_pb2.SamplingParams(stop=["."], min_tokens=3)
    responses = generate(stack, prompt="hi", sampling=sampling)
    assert joined(responses)[0] == "a. b" and responses[-1].finish_reason == "stop"
    assert responses[-1].usage.completion_tokens == 4


def test_stop_string_inside_a_multi_token_delta_drops_the_tokens_after_it(stack, smollm):
    # A slow reader gets several tokens per scheduler message; those after the stop string are not output.
    ids = smollm.hf("one END two three four", add_special_tokens=False)["input_ids"]
    num_kept = next(k for k in range(1, len(ids) + 1) if "END" in smollm.hf.decode(ids[:k]))
    assert num_kept < len(ids)
    stack.fake.script = Script(deltas=[ids], hang=True, logprobs=True)
    sampling = common_pb2.SamplingParams(stop=["END"], logprobs=1)
    responses = generate(stack, prompt="hi", sampling=sampling)
    text, token_ids = joined(responses)
    assert text == "one " and responses[-1].finish_reason == "stop"
    assert token_ids == ids[:num_kept]
    assert [lp.token_id for r in responses for lp in r.logprobs] == token_ids
    assert responses[-1].usage.completion_tokens == num_kept
