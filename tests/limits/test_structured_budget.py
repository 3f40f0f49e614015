"""A structured-output spec costs its own request, not the batch: one whose lexer does not build within the
fuel budget is refused at the frontend (off the event loop, within milliseconds) naming the field, and a
worker's matcher under the same limits ends its own request (EOS only) instead of stalling every step."""

from __future__ import annotations

import json
import time

import pytest

from kvgrid.v1 import common_pb2
from services.tokenizer.grammar_check import GrammarChecker
from services.tokenizer.text_tokenizer import TextTokenizer
from tests.limits.conftest import post

pytestmark = pytest.mark.timeout(300)
EOS = 2
VOCAB = 49152
CHECK_WITHIN_S = 1.0  # what a refusal may take, checking included (the budget is tens of milliseconds)
# Specs past the budget: large counted repetitions, which llguidance's default limits let take most of a second
# on the step that first masks them and tens of milliseconds on every step after.
COSTLY = [
    dict(regex="a{1000000000}"),
    dict(regex="(a{1000}){1000}"),
    dict(regex="a{100000}"),
    dict(json_schema=json.dumps({"type": "string", "pattern": "^a{100000}$"})),
]
# The issue's slow reproductions are cheap for llguidance's derivative-based lexer; with real schemas, they pass.
CHEAP = [
    dict(regex="(a+)+$"),
    dict(json_schema=json.dumps({"type": "object", "properties": {"x": {"type": "string", "pattern": "(a+)+$"}}})),
    dict(json_schema=json.dumps({"type": "string", "minLength": 1000000000})),
    dict(regex=r"\w{2048}"),
    dict(regex="a{4000}"),
    dict(json_schema=json.dumps({"enum": [f"value-{i}" for i in range(1000)]})),
    dict(
        json_schema=json.dumps(
            {
                "type": "object",
                "properties": {
                    **{f"date_{i}": {"type": "string", "format": "date-time"} for i in range(10)},
                    **{f"code_{i}": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4,8}$"} for i in range(10)},
                    **{f"n_{i}": {"type": "integer", "minimum": -(10**12), "maximum": 10**12} for i in range(10)},
                    "email": {"type": "string", "format": "email"},
                    "items": {"type": "array", "items": {"type": "string", "maxLength": 64}, "maxItems": 20},
                },
                "required": ["date_0", "code_0", "n_0"],
            }
        )
    ),
]


@pytest.fixture(scope="module")
def checker(smollm) -> GrammarChecker:
    tokenizer = TextTokenizer.from_files(smollm.files)
    return GrammarChecker.build(tokenizer.to_json(), VOCAB, [EOS])


@pytest.mark.parametrize("spec", COSTLY, ids=lambda s: str(s)[:40])
def test_specs_past_the_budget_are_refused_within_it(checker, spec):
    sampling = common_pb2.SamplingParams(**spec)
    start = time.monotonic()
    field, problem = checker.problem(sampling)
    assert time.monotonic() - start < CHECK_WITHIN_S
    assert field == f"sampling.{next(iter(spec))}" and "too costly to build" in problem, problem
    assert "<" not in problem  # no parser state dumped to the client
    start = time.monotonic()
    assert checker.problem(sampling) == (field, problem) and time.monotonic() - start < 0.01  # once per spec


@pytest.mark.parametrize("spec", CHEAP, ids=lambda s: str(s)[:40])
def test_real_specs_and_the_issues_cheap_ones_pass(checker, spec):
    assert checker.problem(common_pb2.SamplingParams(**spec)) == ("", "")


def test_a_costly_spec_is_a_400_while_another_stream_keeps_its_pace(stack, neighbour):
    cases = [
        ({"structured_outputs": {"regex": "a{1000000000}"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": {"type": "string", "pattern": "^a{100000}$"}}}, "structured_outputs.json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"pattern": "^(ab){60000}$"}}}},
            "response_format.json_schema.schema",
        ),
    ]
    before = len(stack.fake.submits)
    for fields, param in cases:
        start = time.monotonic()
        status, reply = post(stack, "/v1/completions", {"prompt": "Write:", "max_tokens": 8, **fields})
        took = time.monotonic() - start
        assert status == 400 and reply["error"]["param"] == param, reply
        assert "too costly to build" in reply["error"]["message"] and took < CHECK_WITHIN_S, (reply, took)
        print(f"{param}: refused in {took:.3f}s")
    assert len(stack.fake.submits) == before
    status, reply = post(stack, "/v1/completions", {"prompt": "Write:", "structured_outputs": {"regex": "(a+)+$"}})
    assert status == 200, reply
    gap = neighbour.finish(busy_until=time.monotonic())
    print(f"the neighbour's largest gap: {gap:.3f}s")
    assert gap < 0.5


def test_the_worker_ends_a_costly_specs_request_after_one_bounded_step(smollm):
    """A spec that reached a worker without the frontend's check: its first mask is bounded by the fuel, then
    the matcher is in its error state and allows only EOS, which ends the request."""
    import torch

    from services.worker.sampling.structured import GrammarCache, apply_token_masks

    tokenizer = TextTokenizer.from_files(smollm.files)
    grammars = GrammarCache(tokenizer.to_json(), VOCAB, [EOS])
    grammars.constraint(common_pb2.SamplingParams(regex="a"), [])  # llguidance's tokenizer, built once
    constraint = grammars.constraint(common_pb2.SamplingParams(regex="(a{1000}){1000}"), [])
    steps = []
    for _ in range(3):
        logits = torch.zeros(1, VOCAB)
        start = time.monotonic()
        apply_token_masks(logits, [0], [constraint])
        steps.append(time.monotonic() - start)
        allowed = torch.isfinite(logits[0]).nonzero().view(-1).tolist()
        constraint.advance(allowed[0])
    assert allowed == [EOS] and constraint.matcher.is_error()
    print(f"worker mask steps: {[round(t, 3) for t in steps]}s")
    assert max(steps) < 0.5, steps  # llguidance's default limits: most of a second on the first step
