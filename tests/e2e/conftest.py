"""Stacks shared by the end-to-end tests: one float32 stack for the session, started once."""

from __future__ import annotations

import grpc
import pytest
from openai import OpenAI

from tests.e2e.hf_reference import HFReference
from tests.e2e.stack import Stack, running_stack

# Small enough for a busy CPU, large enough for 32 concurrent requests and a 1000-token prompt.
FP32_ARGS = ["--dtype", "float32", "--kv-cache-memory", "512MiB", "--max-model-len", "1024"]


@pytest.fixture(scope="session")
def hf() -> HFReference:
    """Starts loading at once; tests block on it only when they use it."""
    return HFReference()


@pytest.fixture(scope="session")
def fp32_stack(tmp_path_factory, hf) -> Stack:
    with running_stack(tmp_path_factory.mktemp("fp32") / "serve.log", FP32_ARGS) as stack:
        yield stack


@pytest.fixture(scope="session")
def channel(fp32_stack) -> grpc.Channel:
    with grpc.insecure_channel(fp32_stack.addr) as ch:
        yield ch


@pytest.fixture(scope="session")
def scheduler_channel(fp32_stack) -> grpc.Channel:
    with grpc.insecure_channel(fp32_stack.scheduler_addr) as ch:
        yield ch


@pytest.fixture(scope="session")
def base_url(fp32_stack) -> str:
    """The OpenAI-compatible API's base URL on the float32 stack."""
    return f"http://127.0.0.1:{fp32_stack.ports['--http-port']}/v1"


@pytest.fixture(scope="session")
def client(base_url) -> OpenAI:
    with OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model(client) -> str:
    return client.models.list().data[0].id
