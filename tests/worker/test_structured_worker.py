"""Structured outputs through the worker's own gRPC Execute stream, on a tiny random Llama whose unconstrained
text is noise: only the mask makes it valid. A request resumed on a fresh stream with its outputs (what the
scheduler sends after a preemption) samples what it would have sampled."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest

from kvgrid.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common.server import insecure_channel
from services.worker.core import build_core
from services.worker.server import start_worker
from tests.worker.driver import Driver
from tests.worker.smollm import worker_config
from tests.worker.tiny import save_tiny_bytelevel_tokenizer, save_tiny_model, tiny_bytelevel_tokenizer

pytestmark = pytest.mark.timeout(300)
EOS = 262
SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["id", "ok"],
    "additionalProperties": False,
}
SPECS = [
    dict(regex=r"[a-f]{2,5}-[0-9]{2}"),
    dict(choice=common_pb2.Choices(choices=["alpha", "beta", "gamma"])),
    dict(json_schema=json.dumps(SCHEMA)),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-structured"))
    save_tiny_model(path, vocab_size=300, eos_token_id=EOS, max_position_embeddings=256)
    save_tiny_bytelevel_tokenizer(path)
    config = worker_config("float32", kv_cache_memory=8 * 2**20, max_model_len=256, model__model=path)
    return config, build_core(config)


async def with_worker(tiny, work):
    config, core = tiny
    worker = await start_worker(config, 0, core=core)
    try:
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            hs = await stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="test"))
            return await work(stub, hs)
    finally:
        await worker.stop(None)


def text_until_eos(outputs: list[int]) -> str:
    assert EOS in outputs, outputs
    return tiny_bytelevel_tokenizer().decode(outputs[: outputs.index(EOS)])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_holds_to_its_constraint(tiny, temperature):
    async def work(stub, hs):
        driver = Driver(stub.Execute(), hs.block_size, hs.num_blocks)
        out = []
        for spec in SPECS:
            sampling = common_pb2.SamplingParams(temperature=temperature, seed=3, **spec)
            out.append(await driver.generate([[5, 6, 7], [8, 9]], 40, sampling=sampling))
        driver.call.cancel()
        return out

    regex, choice, schema = asyncio.run(with_worker(tiny, work))
    for r in regex:
        assert re.fullmatch(r"[a-f]{2,5}-[0-9]{2}", text_until_eos(r.outputs))
    assert all(text_until_eos(r.outputs) in ("alpha", "beta", "gamma") for r in choice)
    for r in schema:
        jsonschema.validate(json.loads(text_until_eos(r.outputs)), SCHEMA)


def test_a_request_resumed_with_its_outputs_samples_as_if_never_preempted(tiny):
    sampling = common_pb2.SamplingParams(temperature=1.0, seed=9, json_schema=json.dumps(SCHEMA))
    prompt = [11, 12, 13, 14]

    async def decode(stub, hs, outputs: list[int], max_tokens: int) -> list[int]:
        """A fresh stream (empty worker state) and a NewRequest carrying prompt + outputs, then decodes."""
        call = stub.Execute()
        tokens = prompt + outputs
        blocks = list(range(-(-(len(prompt) + max_tokens) // hs.block_size)))
        new = worker_pb2.NewRequest(
            request_id="r",
            token_ids=tokens,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            block_ids=blocks,
            num_scheduled_tokens=len(tokens),
        )
        step = 0
        plan = worker_pb2.StepPlan(step_id=step, new_requests=[new])
        out = list(outputs)
        while len(out) < max_tokens:
            await call.write(plan)
            out.append((await call.read()).sampled[0].token_id)
            step += 1
            plan = worker_pb2.StepPlan(
                step_id=step, running=[worker_pb2.RunningRequest(request_id="r", num_scheduled_tokens=1)]
            )
        call.cancel()
        return out

    async def work(stub, hs):
        straight = await decode(stub, hs, [], 24)
        resumed = await decode(stub, hs, straight[:9], 24)
        return straight, resumed

    straight, resumed = asyncio.run(with_worker(tiny, work))
    assert resumed == straight
    jsonschema.validate(json.loads(text_until_eos(straight)), SCHEMA)
