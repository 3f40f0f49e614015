"""The frontend's per-request record: one completion line and one status count per request, however it ends."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from prometheus_client import generate_latest

from services.common.errors import InvalidArgument
from services.common.logs import JsonFormatter
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.request_metrics import RequestMetrics
from tests.observability.probes import Samples


@pytest.fixture
def log(caplog):
    caplog.set_level(logging.INFO, logger="services.tokenizer.requests")
    return caplog


def test_a_finished_request_logs_its_tokens_and_latencies(log):
    metrics = TokenizerMetrics("m")
    with RequestMetrics(metrics, "") as tracked:
        tracked.begin("r1", 7, trace_id="ab" * 16)
        tracked.output(1)
        tracked.output(2)
        tracked.finish("length")
    (record,) = log.records
    fields = record.fields
    assert (record.request_id, record.trace_id) == ("r1", "ab" * 16)
    assert (fields["finish_reason"], fields["prompt_tokens"], fields["output_tokens"]) == ("length", 7, 3)
    assert 0 <= fields["ttft_s"] <= fields["e2e_s"]
    assert record.getMessage().startswith("request r1 done: length, prompt 7 tokens, output 3 tokens, ttft ")
    line = json.loads(JsonFormatter("tokenizer").format(record))
    assert line["service"] == "tokenizer" and line["request_id"] == "r1" and line["output_tokens"] == 3
    samples = Samples(generate_latest(metrics.registry).decode())
    assert samples.get("kvgrid_requests_total", status="length") == 1
    assert samples.get("kvgrid_inter_token_latency_seconds_count") == 2  # per token after the first response
    assert samples.get("kvgrid_generation_tokens_total") == 3 and samples.get("kvgrid_prompt_tokens_total") == 7


def test_refused_and_cancelled_requests_get_a_line_and_a_status_too(log):
    metrics = TokenizerMetrics("m")
    with pytest.raises(InvalidArgument), RequestMetrics(metrics, "bad"):
        raise InvalidArgument("prompt", "empty")
    with pytest.raises(asyncio.CancelledError), RequestMetrics(metrics, "") as tracked:
        tracked.begin("gone", 3)
        raise asyncio.CancelledError
    assert [(r.request_id, r.fields["finish_reason"], r.fields["ttft_s"]) for r in log.records] == [
        ("bad", "invalid_argument", None),
        ("gone", "cancelled", None),
    ]
    assert "ttft -" in log.records[0].getMessage()
    samples = Samples(generate_latest(metrics.registry).decode())
    assert samples.get("kvgrid_requests_total", status="invalid_argument") == 1
    assert samples.get("kvgrid_requests_total", status="cancelled") == 1
    # only finished requests have an end-to-end latency
    assert samples.get("kvgrid_e2e_request_latency_seconds_count") == 0
