"""A frontend in front of the fake scheduler, serving SmolLM2's real maximum length (8192 tokens, so the
prompt-length cap is its real one), and a neighbour: a stream whose token gaps the tests measure while another
client sends something costly."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

import pytest

from kvgrid.v1 import generate_pb2
from tests.tokenizer.conftest import frontend_stack, handshake, smollm, wait_until  # noqa: F401
from tests.tokenizer.fake_scheduler import Script

MAX_MODEL_LEN = 8192  # SmolLM2-135M-Instruct's
NEIGHBOUR_TOKEN = 42
NEIGHBOUR_STEP_S = 0.01  # the fake scheduler's pause between the neighbour's tokens


@pytest.fixture(scope="module")
def stack(smollm):  # noqa: F811 - the session fixture imported above
    info = handshake(smollm.files)
    info.max_model_len = MAX_MODEL_LEN
    with frontend_stack(info) as running:
        yield running


def post(stack, path: str, body: dict | bytes, timeout: float = 60) -> tuple[int, dict]:
    """POST a JSON body (a dict, or bytes as they are); (status, parsed reply)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", stack.frontend.http_port, timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"content-type": "application/json"})
        reply = conn.getresponse()
        raw = reply.read()
        return reply.status, json.loads(raw) if raw else {}
    finally:
        conn.close()


@dataclass
class Neighbour:
    """A gRPC Generate stream in a thread: when each of its responses arrived."""

    arrivals: list[float] = field(default_factory=list)
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def largest_gap(self) -> float:
        times = self.arrivals
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


@pytest.fixture
def neighbour(stack):
    """Starts a stream of 600 tokens, one every NEIGHBOUR_STEP_S at the fake scheduler (about 6 s plus the
    frontend's own time); waits until its first tokens arrived. The test then does its costly thing, and
    ``finish(busy_until)`` waits for the stream's end and returns the largest gap between its tokens."""
    request_id = f"neighbour-{time.monotonic_ns()}"
    stack.fake.scripts[request_id] = Script(deltas=[[NEIGHBOUR_TOKEN]] * 600, delay_s=NEIGHBOUR_STEP_S)
    n = Neighbour()

    def run() -> None:
        try:
            request = generate_pb2.GenerateRequest(prompt="hi", request_id=request_id)
            for _ in stack.stub.Generate(request, timeout=120):
                n.arrivals.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            n.error = exc

    n.thread = threading.Thread(target=run, daemon=True)
    n.thread.start()
    wait_until(lambda: len(n.arrivals) >= 5, timeout=30, what="the neighbour's first tokens")

    def finish(busy_until: float) -> float:
        """The largest gap; asserts the stream was still running at ``busy_until`` (a time.monotonic())."""
        n.thread.join(120)
        assert n.error is None, n.error
        assert n.arrivals[-1] > busy_until, "the neighbour ended before the costly request did: make it longer"
        return n.largest_gap()

    n.finish = finish
    yield n
    stack.fake.scripts.pop(request_id, None)
