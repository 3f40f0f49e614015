"""One `kvgrid serve` (the default model, float32) for the tool-calling tests, and clients of it."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e.stack import Stack, running_stack

# A chat may bring its own template here (tests/tools/test_request_template.py).
ARGS = ["--dtype", "float32", "--kv-cache-memory", "512MiB", "--max-model-len", "4096", "--trust-request-chat-template"]


@pytest.fixture(scope="session")
def tools_stack(tmp_path_factory) -> Stack:
    with running_stack(tmp_path_factory.mktemp("tools") / "serve.log", ARGS) as stack:
        yield stack


@pytest.fixture(scope="session")
def base_url(tools_stack) -> str:
    return f"http://127.0.0.1:{tools_stack.ports['--http-port']}/v1"


@pytest.fixture(scope="session")
def client(base_url) -> OpenAI:
    with OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        yield c


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id
