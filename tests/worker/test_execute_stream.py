"""The worker's Execute stream with plans sent ahead of their results, as async scheduling sends them.

The next plan is on the stream before the last result is read, and its decode builds on the token
the step before it sampled: each plan must be checked and applied after that step, not when it
arrives. A bad plan fails the stream after the results of the plans before it.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvgrid.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from services.common import config as cfg
from services.common.server import insecure_channel
from services.worker.core import build_core
from services.worker.server import start_worker
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 9, 13, 2, 7, 11]


@pytest.fixture(scope="module", params=["no tiers", "redis tier"])
def setup(request, tmp_path_factory):
    """A worker without KV tiers reads each plan when the step before it is done; one with a Redis tier reads
    plans as they arrive (to start their fetches): either way they must run in order. These plans load nothing,
    so no Redis is dialled."""
    config = cfg.build_config(environ={})
    if request.param == "redis tier":
        config.cache.kv_tiers = "redis"
        config.cache.kv_redis_url = "redis://127.0.0.1:9/0"
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    save_tiny_tokenizer(model_dir)
    config.model.model = model_dir
    config.model.dtype = "float32"
    config.device.device = "cpu"
    config.cache.block_size = 4
    config.model.max_model_len = 64
    config.cache.kv_cache_memory = 64 * 1024
    config.network.host = "127.0.0.1"
    core = build_core(config)
    assert core.fetches_ahead == (request.param == "redis tier")
    return config, core


def prefill(step_id: int, request_id: str = "a") -> worker_pb2.StepPlan:
    new = worker_pb2.NewRequest(
        request_id=request_id,
        token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        sampling=common_pb2.SamplingParams(),
        block_ids=[3, 4, 5],  # room for 12 tokens
        num_computed_tokens=0,
        num_scheduled_tokens=len(PROMPT),
    )
    return worker_pb2.StepPlan(step_id=step_id, new_requests=[new])


def decode(step_id: int, request_id: str = "a") -> worker_pb2.StepPlan:
    return worker_pb2.StepPlan(
        step_id=step_id, running=[worker_pb2.RunningRequest(request_id=request_id, num_scheduled_tokens=1)]
    )


async def _with_stream(config, core, body):
    worker = await start_worker(config, 0, core=core)
    try:
        async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            await stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="test"))
            call = stub.Execute()
            try:
                return await body(call)
            finally:
                call.cancel()
    finally:
        await worker.stop(None)


def test_plans_sent_ahead_run_in_order_on_the_tokens_before_them(setup):
    """Five plans written before any result is read: each decode needs the token of the step before it
    (applied on arrival, the first decode would schedule a token the worker does not know yet)."""
    config, core = setup

    async def body(call):
        for plan in [prefill(1), *(decode(i) for i in range(2, 6))]:
            await call.write(plan)
        return [await call.read() for _ in range(5)]

    results = asyncio.run(_with_stream(config, core, body))
    assert [r.step_id for r in results] == [1, 2, 3, 4, 5]
    assert all(len(r.sampled) == 1 and r.sampled[0].request_id == "a" for r in results)
    assert all(r.execute_seconds > 0 for r in results)

    async def one_at_a_time(call):  # the same tokens when every result is read before the next plan
        tokens = []
        for plan in [prefill(1), *(decode(i) for i in range(2, 6))]:
            await call.write(plan)
            tokens.append((await call.read()).sampled[0].token_id)
        return tokens

    assert asyncio.run(_with_stream(config, core, one_at_a_time)) == [r.sampled[0].token_id for r in results]


def test_a_bad_plan_fails_the_stream_after_the_results_before_it(setup):
    """Plans 1-2 are good, 3 names an unknown request, 4 would be good: results 1 and 2 arrive, then
    INVALID_ARGUMENT; the worker stays usable for the next stream."""
    config, core = setup

    async def body(call):
        for plan in (prefill(1), decode(2), decode(3, request_id="nobody"), decode(4)):
            await call.write(plan)
        first, second = await call.read(), await call.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
        return first, second, err.value

    first, second, error = asyncio.run(_with_stream(config, core, body))
    assert (first.step_id, second.step_id) == (1, 2)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "'nobody' is not known" in error.details()

    async def again(call):
        await call.write(prefill(1, request_id="b"))
        return await call.read()

    assert asyncio.run(_with_stream(config, core, again)).sampled[0].request_id == "b"


def test_an_unparsable_plan_from_the_scheduler_that_handshook_is_invalid_argument(setup):
    """Strangers are refused before their plans are read (tests/e2e/test_unparsable.py); the scheduler's own
    corrupt message still gets the one-line INVALID_ARGUMENT every service answers."""
    config, core = setup

    async def body():
        worker = await start_worker(config, 0, core=core)
        try:
            async with insecure_channel(f"127.0.0.1:{worker.port}") as channel:
                await worker_pb2_grpc.WorkerStub(channel).Handshake(worker_pb2.HandshakeRequest(scheduler_id="t"))
                raw = channel.stream_stream("/kvgrid.v1.Worker/Execute", request_serializer=None)
                call = raw()
                await call.write(b"\x0a\x40abc")  # field 1 claims 64 bytes, 3 follow
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call.read()
                return err.value
        finally:
            await worker.stop(None)

    error = asyncio.run(body())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
    assert "cannot be parsed" in error.details() and "\n" not in error.details()
