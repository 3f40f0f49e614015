"""Fixtures for the frontend tests: the real SmolLM2 tokenizer files, and a frontend in front of a fake scheduler.

Servers run on an asyncio loop in a background thread; tests talk to them with
blocking gRPC clients, as a user would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import dataclass

import grpc
import pytest

from kvgrid.v1 import generate_pb2, generate_pb2_grpc, worker_pb2
from services.common.config import (
    Config,
    ModelConfig,
    NetworkConfig,
    ObservabilityConfig,
    ResponsesConfig,
    SchedulerConfig,
)
from services.tokenizer.text_tokenizer import read_tokenizer_dir

os.environ["HF_HUB_OFFLINE"] = "1"
MAX_MODEL_LEN = 256
VOCAB_SIZE = 49152


class LoopThread:
    """An asyncio loop running in a daemon thread; ``run`` executes a coroutine on it and waits."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@dataclass(slots=True)
class SmolTokenizer:
    dir: str
    files: dict[str, bytes]
    hf: object  # transformers tokenizer loaded from the same files


@pytest.fixture(scope="session")
def smollm(tmp_path_factory) -> SmolTokenizer:
    """SmolLM2's tokenizer as the worker would send it: transformers reads the GGUF and saves the files."""
    from transformers import AutoTokenizer

    from services.common.default_model import default_model_path

    gguf = default_model_path()
    hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    hf.save_pretrained(out)
    return SmolTokenizer(dir=str(out), files=read_tokenizer_dir(str(out)), hf=hf)


def handshake(files: dict[str, bytes], worker_id: str = "worker-1") -> worker_pb2.HandshakeResponse:
    return worker_pb2.HandshakeResponse(
        model="SmolLM2-135M-Instruct",
        architecture="LlamaForCausalLM",
        dtype="float32",
        device="cpu",
        block_size=16,
        num_blocks=123,
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB_SIZE,
        eos_token_ids=[2],
        tokenizer_files=files,
        worker_id=worker_id,
    )


def frontend_config(scheduler_addr: str, tokenizer: str = "") -> Config:
    return Config(
        model=ModelConfig(tokenizer=tokenizer),
        scheduler=SchedulerConfig(),
        observability=ObservabilityConfig(),
        network=NetworkConfig(host="127.0.0.1", scheduler_addr=scheduler_addr),
    )


@dataclass(slots=True)
class Stack:
    loop: LoopThread
    fake: object  # FakeScheduler
    scheduler_health: object  # Health of the fake scheduler
    frontend: object  # TokenizerServer
    channel: grpc.Channel
    stub: generate_pb2_grpc.TextGenerationStub


@pytest.fixture(scope="module")
def stack(smollm):
    with frontend_stack(handshake(smollm.files)) as running:
        yield running


@contextlib.contextmanager
def frontend_stack(info: worker_pb2.HandshakeResponse, responses: ResponsesConfig | None = None):
    """A frontend in front of the fake scheduler, which hands out ``info``; stopped after the ``with``."""
    from services.tokenizer.server import start_tokenizer
    from tests.tokenizer.fake_scheduler import start_fake_scheduler

    loop = LoopThread()
    sched_server, fake, health, port = loop.run(start_fake_scheduler(info))
    config = frontend_config(f"127.0.0.1:{port}")
    config.responses = responses
    frontend = loop.run(start_tokenizer(config))
    wait_until(lambda: frontend.state.serving, what="the frontend to serve")
    channel = grpc.insecure_channel(f"127.0.0.1:{frontend.port}")
    yield Stack(loop, fake, health, frontend, channel, generate_pb2_grpc.TextGenerationStub(channel))
    channel.close()
    loop.run(frontend.stop(0))
    loop.run(sched_server.stop(0))
    loop.close()


def generate(stack, timeout=30, **fields) -> list[generate_pb2.GenerateResponse]:
    """One Generate call through the stack's frontend: every streamed response."""
    return list(stack.stub.Generate(generate_pb2.GenerateRequest(**fields), timeout=timeout))


def joined(responses) -> tuple[str, list[int]]:
    """The streamed text and token ids, put together."""
    return "".join(r.text for r in responses), [t for r in responses for t in r.token_ids]
