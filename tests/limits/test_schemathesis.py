"""Schemathesis over the HTTP API's OpenAPI schema, generated from the FastAPI app the frontend serves, against
that frontend on a free port in front of the fake scheduler (no model): bodies valid under the schema and bodies
that break it, and not one 5xx nor one response whose body breaks the schema.

What the schema does not say yet is an expected failure: it documents 200 as application/json and FastAPI's
422, while the API streams text/event-stream and answers OpenAI's error object with 400, 404, 413 and 503."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.tokenizer.fake_scheduler import Script

CHECKS = [not_a_server_error, response_schema_conformance]
DOCUMENTED = [status_code_conformance, content_type_conformance]


def run_schemathesis(stack, max_examples: int, checks=CHECKS) -> dict[int, int]:
    """Every operation in both generation modes; returns how many responses had each status. Fails listing
    every distinct failure (not only the first, as a Hypothesis test would)."""
    stack.fake.script = Script(deltas=[[42], [43]])
    app = stack.frontend.http._app  # the app this frontend serves
    schema = schemathesis.openapi.from_dict(app.openapi())
    base_url = f"http://127.0.0.1:{stack.frontend.http_port}"
    statuses: dict[int, int] = {}
    failures: dict[str, str] = {}
    for result in schema.get_all_operations():
        for mode in GenerationMode:
            fuzz(result.ok(), mode, base_url, max_examples, checks, statuses, failures)
    assert not failures, "\n\n".join(f"{key}:\n{text}" for key, text in failures.items())
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0  # both kinds of bodies reached the API
    return statuses


def fuzz(operation, mode, base_url: str, max_examples: int, checks, statuses: dict, failures: dict) -> None:
    """One operation's cases in one generation mode, counted in ``statuses``; ``failures`` collects them."""

    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: a failure here is reproducible
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        response = case.call(base_url=base_url, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        try:
            case.validate_response(response, checks=checks)
        except BaseExceptionGroup as group:  # schemathesis' FailureGroup: one entry per failed check
            for failure in group.exceptions:
                key = f"{operation.label} {type(failure).__name__} {response.status_code}"
                failures.setdefault(key, f"{failure}\n{case.as_curl_command()}"[:2000])

    try:
        run()
    except Unsatisfiable:  # nothing to break: GET /v1/models takes no input
        assert mode is GenerationMode.NEGATIVE


def test_schemathesis_bounded(stack):
    """About 300 cases: a few seconds of `make test`."""
    print(run_schemathesis(stack, max_examples=30))


def test_schemathesis_every_status_and_content_type_is_documented(stack):
    run_schemathesis(stack, max_examples=10, checks=DOCUMENTED)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_schemathesis_long(stack):
    """About 4,000 cases (`make test-slow`)."""
    print(run_schemathesis(stack, max_examples=400))
