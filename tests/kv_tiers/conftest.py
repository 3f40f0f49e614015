"""A tiny random Llama (float32) and a real Redis for the KV tier suites."""

from __future__ import annotations

import pytest

from kvgrid import LLM
from tests.kv_tiers.groups import TINY, tokens
from tests.kv_tiers.redis_server import RedisServer
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama-kv"))
    save_tiny_model(path, max_position_embeddings=256)
    save_tiny_tokenizer(path, vocab_size=158)
    return path


@pytest.fixture
def redis_server():
    server = RedisServer().start()  # skips without redis-server
    yield server
    server.stop()


@pytest.fixture(scope="session")
def recompute(tiny_model) -> LLM:
    return LLM(model=tiny_model, enable_prefix_caching=False, **TINY)


@pytest.fixture(scope="session")
def reference(recompute):
    cache: dict[tuple, list[int]] = {}

    def expected(batch: list[list[int]]) -> list[list[int]]:
        missing = [p for p in batch if tuple(p) not in cache]
        for p, out in zip(missing, tokens(recompute, missing) if missing else [], strict=True):
            cache[tuple(p)] = out
        return [cache[tuple(p)] for p in batch]

    return expected
