"""/v1/responses over real HTTP in front of the fake scheduler: what reaches the scheduler, the SSE framing, the
store's count bound, upstream errors as statuses, and a client that goes away mid-stream."""

from __future__ import annotations

import http.client
import json

import grpc
import pytest

from services.common.config import ResponsesConfig
from tests.tokenizer.conftest import frontend_stack, handshake, wait_until
from tests.tokenizer.fake_scheduler import Script
from tests.tokenizer.test_openai_http import post

pytestmark = pytest.mark.timeout(120)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.fixture(scope="module")
def stack(smollm):
    with frontend_stack(handshake(smollm.files), ResponsesConfig(max_stored_responses=2)) as running:
        yield running


def get(stack, path: str, method: str = "GET") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", stack.frontend.http_port, timeout=30)
    conn.request(method, path)
    reply = conn.getresponse()
    body = json.loads(reply.read())
    conn.close()
    return reply.status, body


def sse_events(raw: str) -> list[dict]:
    """Each block is ``event: <type>`` and ``data: <json>`` of that type."""
    assert raw.endswith("\n\n")
    out = []
    for block in raw.split("\n\n")[:-1]:
        event, data = block.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert event == f"event: {body['type']}"
        out.append(body)
    return out


def test_the_request_reaches_the_scheduler_as_its_chat_request(stack, smollm):
    ids = smollm.hf('{"a": 1}', add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids])
    body = {
        "instructions": "Be brief.",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Give me a."}]}],
        "max_output_tokens": len(ids),
        "temperature": 0.25,
        "top_p": 0.5,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}},
    }
    status, out = post(stack, "/v1/responses", body)
    assert status == 200, out
    submitted = stack.fake.submits[-1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Give me a."}]
    expected = smollm.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(submitted.prompt_token_ids) == list(expected)
    s = submitted.sampling
    assert s.max_tokens == len(ids) and s.temperature == 0.25 and s.top_p == 0.5
    assert json.loads(s.json_schema) == SCHEMA
    assert out["status"] == "incomplete" and out["incomplete_details"] == {"reason": "max_output_tokens"}
    assert out["output"][0]["content"][0]["text"] == '{"a": 1}'
    assert out["usage"]["input_tokens"] == len(expected) and out["usage"]["output_tokens"] == len(ids)


def test_events_are_framed_with_their_type_and_numbered(stack, smollm):
    ids = smollm.hf(" one two", add_special_tokens=False)["input_ids"]
    stack.fake.script = Script(deltas=[[t] for t in ids], finish=1)  # FINISH_REASON_STOP
    status, raw = post(stack, "/v1/responses", {"input": "Count.", "stream": True})
    assert status == 200
    events = sse_events(raw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "response.completed"
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == " one two" == events[-1]["response"]["output"][0]["content"][0]["text"]


def test_past_the_bound_the_oldest_response_is_forgotten(stack):
    stack.fake.script = Script(deltas=[[42]])
    made = []
    for _ in range(3):
        status, out = post(stack, "/v1/responses", {"input": "hi"})
        assert status == 200
        made.append(out["id"])
    assert [get(stack, f"/v1/responses/{rid}")[0] for rid in made] == [404, 200, 200]
    status, body = post(stack, "/v1/responses", {"input": "hi", "previous_response_id": made[0]})
    assert status == 404 and body["error"]["param"] == "previous_response_id"
    assert made[0] in body["error"]["message"]
    assert get(stack, f"/v1/responses/{made[1]}", "DELETE") == (
        200,
        {"id": made[1], "object": "response.deleted", "deleted": True},
    )
    assert get(stack, f"/v1/responses/{made[1]}")[0] == 404


@pytest.mark.parametrize(
    ("code", "status"), [(grpc.StatusCode.RESOURCE_EXHAUSTED, 429), (grpc.StatusCode.UNAVAILABLE, 503)]
)
def test_scheduler_errors_become_http_statuses(stack, code, status):
    stack.fake.script = Script(error=code)
    for stream in (False, True):
        got, body = post(stack, "/v1/responses", {"input": "hi", "stream": stream})
        assert got == status and body["error"]["code"] == code.name.lower()
        assert "Traceback" not in body["error"]["message"]


def test_a_client_gone_mid_stream_aborts_upstream_and_nothing_is_stored(stack):
    stack.fake.script = Script(deltas=[[42]], hang=True)
    before = len(stack.fake.submits)
    conn = http.client.HTTPConnection("127.0.0.1", stack.frontend.http_port, timeout=30)
    body = json.dumps({"input": "hi", "stream": True})
    conn.request("POST", "/v1/responses", body=body, headers={"content-type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 200 and reply.readline() == b"event: response.created\n"
    created = json.loads(reply.readline().removeprefix(b"data: "))
    conn.sock.close()
    conn.close()
    wait_until(lambda: len(stack.fake.submits) > before, what="the submit")
    rid = stack.fake.submits[-1].request_id
    assert created["response"]["id"] == f"resp_{rid}"
    wait_until(lambda: rid in stack.fake.aborts, what="Abort at the scheduler")
    assert get(stack, f"/v1/responses/resp_{rid}")[0] == 404
