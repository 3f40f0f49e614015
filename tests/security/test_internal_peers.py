"""Internal RPCs trust only their peers: the worker takes one plan stream at a time, from the scheduler that
handshook; Scheduler.Submit holds a request to the frontend's rules."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from kvgrid.v1 import common_pb2, scheduler_pb2, worker_pb2, worker_pb2_grpc
from services.common import config as cfg
from services.common.server import insecure_channel
from services.worker.core import build_core
from services.worker.server import start_worker
from tests.scheduler.harness import stack as scheduler_stack
from tests.scheduler.harness import submit_request
from tests.worker.tiny import save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

PROMPT = [5, 9, 13, 2]


@pytest.fixture(scope="module")
def worker_setup(tmp_path_factory):
    config = cfg.build_config(environ={})
    model_dir = save_tiny_model(str(tmp_path_factory.mktemp("tiny")))
    save_tiny_tokenizer(model_dir)
    config.model.model = model_dir
    config.model.dtype = "float32"
    config.device.device = "cpu"
    config.cache.block_size = 4
    config.model.max_model_len = 64
    config.cache.kv_cache_memory = 64 * 1024
    config.network.host = "127.0.0.1"
    return config, build_core(config)


def prefill(request_id: str) -> worker_pb2.StepPlan:
    new = worker_pb2.NewRequest(
        request_id=request_id,
        token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        sampling=common_pb2.SamplingParams(),
        block_ids=[0, 1],  # the blocks another scheduler's requests may hold
        num_scheduled_tokens=len(PROMPT),
    )
    return worker_pb2.StepPlan(step_id=1, new_requests=[new])


async def refusal(call, plan: worker_pb2.StepPlan) -> grpc.aio.AioRpcError:
    """How the worker ends ``call`` after ``plan`` (the write itself may already fail: the call is over)."""
    with contextlib.suppress(grpc.aio.AioRpcError):
        await call.write(plan)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call.read()
    return err.value


def test_a_second_execute_stream_is_refused_while_the_first_is_open_and_accepted_after(worker_setup):
    config, core = worker_setup

    async def body():
        worker = await start_worker(config, 0, core=core)
        addr = f"127.0.0.1:{worker.port}"
        try:
            async with insecure_channel(addr) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                await stub.Handshake(worker_pb2.HandshakeRequest(scheduler_id="scheduler"))
                first = stub.Execute()
                await first.write(prefill("mine"))
                assert (await first.read()).sampled[0].request_id == "mine"
                error = await refusal(stub.Execute(), prefill("intruder"))
                assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "another plan stream is open" in error.details()
                # The first stream is unharmed, and once it ends the next one is taken.
                await first.write(
                    worker_pb2.StepPlan(
                        step_id=2, running=[worker_pb2.RunningRequest(request_id="mine", num_scheduled_tokens=1)]
                    )
                )
                assert (await first.read()).step_id == 2
                await first.done_writing()
                assert await first.read() == grpc.aio.EOF
                third = stub.Execute()
                await third.write(prefill("next"))
                assert (await third.read()).sampled[0].request_id == "next"
                third.cancel()
        finally:
            await worker.stop(None)

    asyncio.run(body())


def test_plans_only_from_the_connection_of_the_last_handshake(worker_setup):
    config, core = worker_setup

    async def body():
        worker = await start_worker(config, 0, core=core)
        addr = f"127.0.0.1:{worker.port}"
        try:
            # Its own connection: channels of one process to one address share one by default.
            local = [("grpc.use_local_subchannel_pool", 1)]
            async with grpc.aio.insecure_channel(addr, options=local) as stranger:
                error = await refusal(worker_pb2_grpc.WorkerStub(stranger).Execute(), prefill("x"))
                assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "Handshake" in error.details()
                async with insecure_channel(addr) as scheduler:
                    await worker_pb2_grpc.WorkerStub(scheduler).Handshake(worker_pb2.HandshakeRequest())
                    # another connection handshook: still not this one
                    error = await refusal(worker_pb2_grpc.WorkerStub(stranger).Execute(), prefill("x"))
                    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            await worker.stop(None)

    asyncio.run(body())


def test_scheduler_submit_applies_the_frontend_s_checks():
    async def body():
        async with scheduler_stack(worker_kw={"num_blocks": 32, "block_size": 4}) as s:
            cases = [
                (submit_request("huge", [3, 4, 5], max_tokens=2**32 - 1), "sampling.max_tokens"),
                (submit_request("p", [3, 4], top_p=1.5), "sampling.top_p"),
                (submit_request("t", [3, 4], temperature=float("nan")), "sampling.temperature"),
                (submit_request("l", [3, 4], logprobs=21), "sampling.logprobs"),
                (submit_request("m", [3, 4], max_tokens=2, min_tokens=3), "sampling.min_tokens"),
                (submit_request("x" * 300, [3, 4]), "request_id"),
                (submit_request("s", [3, 4], stop_token_ids=[10**6]), "sampling.stop_token_ids[0]"),
            ]
            for request, field in cases:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in s.stub.Submit(request):
                        pass
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
                assert err.value.details().startswith(f"{field}:"), err.value.details()
            # The same checks on the frontend's Connect stream: the request fails alone, the stream lives on.
            call = s.stub.Connect()
            huge = submit_request("c-huge", [3, 4], max_tokens=2**32 - 1)
            await call.write(
                scheduler_pb2.FrontendMessage(submits=[huge, submit_request("c-ok", [3, 4], max_tokens=2)])
            )
            deltas = {}
            async for message in call:
                for delta in message.deltas:
                    deltas.setdefault(delta.request_id, []).append(delta)
                if any(d.finish_reason for d in deltas.get("c-ok", ())):
                    break
            assert deltas["c-huge"][0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "sampling.max_tokens" in deltas["c-huge"][0].error_message
            call.cancel()
            tokens = [t async for r in s.stub.Submit(submit_request("fine", [3, 4], max_tokens=3)) for t in r.token_ids]
            assert len(tokens) == 3

    asyncio.run(asyncio.wait_for(body(), 60))
