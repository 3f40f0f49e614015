"""A tiny random Llama (float32) and a real Redis for the KV tier suites."""

from __future__ import annotations

import pytest

from tests.kv_tiers.redis_server import REDIS_SERVER, RedisServer
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

# 2 layers x 2 KV heads x 16 dims in float32: 8 KiB per 16-token block; 20 blocks hold 320 tokens, so two
# 150-token prompts evict each other's prefix.
TINY = dict(dtype="float32", max_model_len=256, num_threads=1, kv_cache_memory="160KiB", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-llama-kv"))
    save_tiny_model(path, max_position_embeddings=256)
    save_tiny_tokenizer(path, vocab_size=158)
    return path


@pytest.fixture
def redis_server():
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; `make test` does)")
    server = RedisServer().start()
    yield server
    server.stop()
