"""A long conversation on a model whose every layer slides over a window, through the real worker and scheduler:
the scheduler frees the blocks behind each request's window, so the KV usage GetStats reports stays bounded by the
window while the conversation grows far past what the pool holds, and every turn's greedy output equals
transformers'."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kvgrid.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.server import insecure_channel
from services.scheduler.server import start
from services.worker.core import build_core
from services.worker.server import start_worker
from tests.scheduler.harness import submit_request
from tests.scheduler.test_connect import Frontend
from tests.worker.test_service_async_scheduling import _config
from tests.worker.tiny import hf_model, save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)

WINDOW, BLOCK_SIZE, STEP_TOKENS = 8, 4, 8
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # k and v, 2 layers, 2 KV heads of 16, float32
NUM_BLOCKS = 12  # 48 tokens: the conversation below reaches 200
# A request holds the blocks of its window before a step and those of the step.
MAX_HELD = -(-(WINDOW - 1 + STEP_TOKENS) // BLOCK_SIZE) + 1


def _configs(model_dir: str):
    worker = _config(model_dir, False)
    worker.model.max_model_len = 256
    worker.cache.kv_cache_memory = NUM_BLOCKS * BLOCK_BYTES
    for c in (worker,):
        c.scheduler.max_num_batched_tokens = STEP_TOKENS
    return worker


async def _converse(model_dir: str, core, turns: list[list[int]], max_tokens: int) -> tuple[list, list, object]:
    config = _configs(model_dir)
    worker = await start_worker(config, 0, core=core)
    scheduler_config = _configs(model_dir)
    scheduler_config.network.worker_addr = f"127.0.0.1:{worker.port}"
    scheduler = await start(scheduler_config)
    conversation: list[int] = []
    outputs, usage = [], []
    try:
        async with insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            while not scheduler.engine.ready:
                await asyncio.sleep(0.05)
            frontend = Frontend(stub)
            for i, user in enumerate(turns):
                conversation += user
                rid = f"turn-{i}"
                await frontend.send([submit_request(rid, list(conversation), max_tokens=max_tokens, ignore_eos=True)])
                while rid not in frontend.finish:  # KV usage while the turn runs
                    stats = await stub.GetStats(scheduler_pb2.GetStatsRequest())
                    usage.append(stats.num_blocks_used)
                    await asyncio.sleep(0.005)
                outputs.append((list(conversation), list(frontend.tokens[rid])))
                conversation += frontend.tokens[rid]
            frontend.call.cancel()
            return outputs, usage, await stub.GetStats(scheduler_pb2.GetStatsRequest())
    finally:
        await scheduler.stop(0.5)
        await worker.stop(None)


def test_a_long_conversation_keeps_kv_usage_within_the_window(tmp_path):
    model_dir = str(tmp_path / "mistral")
    save_tiny_model(model_dir, "mistral", seed=4, sliding_window=WINDOW)
    save_tiny_tokenizer(model_dir)
    core = build_core(_configs(model_dir))
    assert core.handshake.sliding_window == WINDOW and core.handshake.num_blocks == NUM_BLOCKS
    turns = [[(17 * t + 5 * i) % 150 for i in range(10 + t)] for t in range(6)]
    outputs, usage, stats = asyncio.run(_converse(model_dir, core, turns, max_tokens=20))
    assert len(outputs[-1][0]) + 20 > 4 * NUM_BLOCKS * BLOCK_SIZE  # far more than the pool holds at once
    assert usage and max(usage) <= MAX_HELD < NUM_BLOCKS
    assert stats.num_preemptions == 0 and stats.num_blocks_used == 0
    hf = hf_model(model_dir)
    for prompt, tokens in outputs:
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
        assert tokens == out[0, len(prompt) :].tolist(), len(prompt)
