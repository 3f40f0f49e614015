"""Greedy generation through the worker's own gRPC API equals transformers on the default SmolLM2 model."""

from __future__ import annotations

import asyncio
import copy

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgrid.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.server import insecure_channel
from services.worker.core import build_core
from services.worker.quant import matmul
from services.worker.server import start_worker
from tests.worker.driver import Driver
from tests.worker.smollm import hf_greedy, hf_reference, prompt_ids, worker_config

pytestmark = pytest.mark.timeout(600)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference():
    return hf_reference(torch.float32)


@pytest.fixture(scope="module")
def core_fp32():
    return build_core(worker_config("float32"))


async def _generate(config, core, prompts, chunk, sampling=None, extra=None):
    worker = await start_worker(config, 0, core=core)
    try:
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            stub = worker_pb2_grpc.WorkerStub(channel)
            hs = await stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="test"))
            driver = Driver(stub.Execute(), hs.block_size, hs.num_blocks)
            reqs = await driver.generate(prompts, MAX_TOKENS, chunk=chunk, sampling=sampling)
            if extra is not None:
                await extra(stub, driver, reqs)
            driver.call.cancel()
            return hs, reqs
    finally:
        await worker.stop(None)


def test_handshake(core_fp32, reference):
    _, tokenizer = reference
    hs = core_fp32.handshake
    assert (hs.architecture, hs.dtype, hs.device, hs.block_size) == ("LlamaForCausalLM", "float32", "cpu", 16)
    assert hs.model == "SmolLM2-135M-Instruct" and hs.vocab_size == 49152 and hs.max_model_len == 1024
    assert hs.bytes_per_block == 2 * 30 * 16 * 3 * 64 * 4
    assert hs.num_blocks == 64 * 2**20 // hs.bytes_per_block
    assert hs.memory.method == "cpu-configured" and hs.memory.kv_cache_bytes == hs.num_blocks * hs.bytes_per_block
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in hs.eos_token_ids
    assert "tokenizer.json" in hs.tokenizer_files and "tokenizer_config.json" in hs.tokenizer_files
    assert len(hs.worker_id) == 32 and hs.load_seconds > 0


@pytest.mark.parametrize("cpu_kernels", ["native", "torch"])
def test_greedy_float32_equals_transformers(core_fp32, reference, cpu_kernels):
    """Decode steps of up to 16 requests run on the native CPU kernels by default; both paths are held to it."""
    model, tokenizer = reference
    prompts = prompt_ids(tokenizer)
    assert len(prompts) >= 4 and max(len(p) for p in prompts) > 16
    core = core_fp32 if cpu_kernels == "native" else build_core(worker_config("float32", device__cpu_kernels="torch"))
    assert (core.runner.model.native_path is not None) == (cpu_kernels == "native")
    # Prefill in chunks of 7 tokens: chunks that do not finish a prompt sample nothing.
    _, reqs = asyncio.run(_generate(worker_config("float32"), core, prompts, chunk=7))
    for prompt, req in zip(prompts, reqs, strict=True):
        expected, _ = hf_greedy(model, prompt, MAX_TOKENS)
        assert req.outputs == expected, tokenizer.decode(prompt)


def test_second_stream_starts_empty(core_fp32, reference):
    _, tokenizer = reference

    async def reconnect(stub, driver, reqs):
        driver.call.cancel()  # a worker takes one plan stream at a time: the scheduler's next one after this
        call = stub.Execute()
        await call.write(worker_pb2.StepPlan(step_id=1, running=[worker_pb2.RunningRequest(request_id=reqs[0].rid)]))
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not known" in err.value.details()

    prompt = prompt_ids(tokenizer)[:1]
    asyncio.run(_generate(worker_config("float32"), core_fp32, prompt, chunk=64, extra=reconnect))


def test_min_tokens_bans_eos_until_reached(core_fp32, reference):
    _, tokenizer = reference
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=False
    )
    prompt = [tokenizer(chat)["input_ids"]]
    eos = set(core_fp32.handshake.eos_token_ids)
    config = worker_config("float32")
    _, (free,) = asyncio.run(_generate(config, core_fp32, prompt, chunk=64))
    assert eos & set(free.outputs[:12]), "premise: unconstrained greedy ends its short answer early"
    banned = common_pb2.SamplingParams(min_tokens=MAX_TOKENS)
    _, (held,) = asyncio.run(_generate(config, core_fp32, prompt, chunk=64, sampling=banned))
    assert not eos & set(held.outputs), tokenizer.decode(held.outputs)
    first_eos = min(i for i, t in enumerate(free.outputs) if t in eos)
    assert held.outputs[:first_eos] == free.outputs[:first_eos]


def test_greedy_bfloat16_within_top5(reference):
    """Where bf16 rounding flips a near-tie, each side's token is in the other's top 5 (then they diverge).

    Every step runs on the native CPU kernels in bf16 here (prefill chunks attend through SDPA)."""
    model, tokenizer = reference
    hf_bf16 = copy.deepcopy(model).to(torch.bfloat16)  # the module's fp32 reference stays as it is
    prompts = prompt_ids(tokenizer)
    config = worker_config("bfloat16")
    core = build_core(config)
    assert core.handshake.dtype == "bfloat16" and core.runner.model.native_path is not None
    sampling = common_pb2.SamplingParams(logprobs=5)
    _, reqs = asyncio.run(_generate(config, core, prompts, chunk=64, sampling=sampling))
    for prompt, req in zip(prompts, reqs, strict=True):
        expected, hf_logits = hf_greedy(hf_bf16, prompt, MAX_TOKENS)
        for pos, (ours, theirs) in enumerate(zip(req.outputs, expected, strict=True)):
            if ours == theirs:
                continue
            our_top5 = [t.token_id for t in req.logprobs[pos].top]
            their_top5 = hf_logits[pos].topk(5).indices.tolist()
            assert theirs in our_top5 and ours in their_top5, (pos, ours, theirs)
            break


def teacher_forced_ranks(model, prompt: list[int], outputs: list[int]) -> list[int]:
    """Rank of each output token in the reference's distribution given the prompt and the outputs before it."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + outputs])).logits[0, len(prompt) - 1 : -1]  # [len(outputs), vocab]
    chosen = logits.gather(1, torch.tensor(outputs)[:, None])
    return (logits > chosen).sum(-1).tolist()


@pytest.mark.parametrize(
    "quantization,gemm_rows", [("int8", 1), ("int8", None), ("gguf", None)], ids=["int8-gemm", "int8", "gguf"]
)
def test_quantized_greedy_within_float32_top5(reference, monkeypatch, quantization, gemm_rows):
    """Quantized weights: every greedy token is in float32 transformers' top 5 under teacher forcing,
    and at least 90% are its top 1. Prefill chunks and decode steps both read the packed weights.
    int8 runs each way for every product: oneDNN's int8 GEMM (per-row activation scales, two terms)
    and the native kernel."""
    monkeypatch.setattr(matmul, "INT8_GEMM_ROWS", gemm_rows)
    model, tokenizer = reference
    prompts = prompt_ids(tokenizer)
    config = worker_config("float32", load__quantization=quantization)
    core = build_core(config)
    assert core.runner.model.native_path is not None
    assert core.handshake.dtype == "float32" and core.runner.model.layers[0].mlp.down_proj.packed is not None
    _, reqs = asyncio.run(_generate(config, core, prompts, chunk=7))
    ranks = [
        rank
        for prompt, req in zip(prompts, reqs, strict=True)
        for rank in teacher_forced_ranks(model, prompt, req.outputs)
    ]
    assert len(ranks) == len(prompts) * MAX_TOKENS
    assert max(ranks) < 5, ranks
    assert sum(rank == 0 for rank in ranks) >= 0.9 * len(ranks), ranks
