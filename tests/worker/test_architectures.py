"""Each architecture beyond Llama, served by the real worker and scheduler over gRPC, gives transformers' greedy
tokens: Qwen3 (q/k norms), Phi-3 (fused checkpoint tensors), Gemma 3 (sliding-window and global layers
interleaved), Mistral with a sliding window on every layer, and the mixtures of experts Mixtral and Qwen3-MoE.
Prompts run past the window, prefills are chunked, and the KV pool is small enough that requests are preempted
and recomputed."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from kvgrid.v1 import scheduler_pb2_grpc
from services.common.server import insecure_channel
from services.scheduler.server import start
from services.worker.core import build_core
from services.worker.server import start_worker
from tests.scheduler.harness import submit_request
from tests.scheduler.test_connect import Frontend
from tests.worker.test_service_async_scheduling import _config
from tests.worker.tiny import hf_model, save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)

WINDOW = 8
MODELS = {
    "qwen3": ("qwen3", {}),
    "phi3": ("phi3", {}),
    "gemma3": ("gemma3", {"sliding_window": WINDOW}),
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "mixtral": ("mixtral", {}),
    "qwen3-moe": ("qwen3_moe", {}),
}


def _requests() -> list:
    rng = random.Random(7)
    prompts = [[rng.randrange(0, 150) for _ in range(n)] for n in (3, 9, 17, 26, 31, 12, 40, 5)]
    return [submit_request(f"r{i}", p, max_tokens=rng.randint(6, 20), ignore_eos=True) for i, p in enumerate(prompts)]


def _worker_config(model_dir: str, name: str):
    config = _config(model_dir, False)
    config.scheduler.max_num_batched_tokens = 16  # long prompts prefill in chunks
    if name == "mistral-window":  # blocks behind the window are freed: a smaller pool still preempts
        config.cache.kv_cache_memory = 16 * 1024
    return config


async def _serve(model_dir: str, name: str, core, requests) -> tuple[dict, int]:
    worker = await start_worker(_worker_config(model_dir, name), 0, core=core)
    scheduler_config = _config(model_dir, False, f"127.0.0.1:{worker.port}")
    scheduler_config.scheduler.max_num_batched_tokens = 16
    scheduler = await start(scheduler_config)
    try:
        async with insecure_channel(f"127.0.0.1:{scheduler.port}") as channel:
            frontend = Frontend(scheduler_pb2_grpc.SchedulerStub(channel))
            while not scheduler.engine.ready:
                await asyncio.sleep(0.05)
            await frontend.send(requests)
            await frontend.wait(lambda: frontend.ended([r.request_id for r in requests]), timeout=240)
            frontend.call.cancel()
            return dict(frontend.tokens), scheduler.engine.stats().num_preemptions
    finally:
        await scheduler.stop(0.5)
        await worker.stop(None)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_through_the_worker_equals_transformers(tmp_path, name):
    kind, overrides = MODELS[name]
    model_dir = str(tmp_path / name)
    save_tiny_model(model_dir, kind, seed=3, **overrides)
    save_tiny_tokenizer(model_dir)
    core = build_core(_worker_config(model_dir, name))
    assert core.handshake.architecture == hf_model(model_dir).config.architectures[0]
    requests = _requests()
    tokens, preemptions = asyncio.run(_serve(model_dir, name, core, requests))
    assert preemptions > 0
    hf = hf_model(model_dir)
    for r in requests:
        prompt = list(r.prompt_token_ids)
        with torch.inference_mode():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=r.sampling.max_tokens, do_sample=False, eos_token_id=None
            )
        assert tokens[r.request_id] == out[0, len(prompt) :].tolist(), r.request_id
