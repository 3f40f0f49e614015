"""Groups for the KV tier suites: an in-process scheduler core and worker runner (``kvgrid.LLM``) on the tiny
model, with tiers configured by flags, and the prompts and greedy runs the suites compare."""

from __future__ import annotations

import random

from kvgrid import LLM, SamplingParams

# 2 layers x 2 KV heads x 16 dims in float32: 8 KiB per 16-token block; 20 blocks hold 320 tokens, so two
# 150-token prompts evict each other's prefix.
TINY = dict(dtype="float32", max_model_len=256, num_threads=1, kv_cache_memory="160KiB", seed=0)

GREEDY = SamplingParams(max_tokens=6, temperature=0)


def prompts(seed: int, n: int = 3, length: int = 150) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 150) for _ in range(length)] for _ in range(n)]


def tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(batch, GREEDY, use_tqdm=False)]


def tiers_of(llm: LLM):
    return llm.engine.scheduler.tiers


def group(tiny_model: str, redis_url: str | None, tiers: str = "redis", **options) -> LLM:
    return LLM(model=tiny_model, kv_tiers=tiers, kv_redis_url=redis_url, **{**TINY, **options})
