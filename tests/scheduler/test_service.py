"""End-to-end: the scheduler service over real gRPC against a fake worker."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvgrid.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.config import ModelConfig
from services.common.server import NOT_SERVING, SERVING, insecure_channel
from services.scheduler.server import start
from tests.scheduler.fake_worker import generate, start_fake_worker
from tests.scheduler.harness import collect, make_config, stack, submit_request

pytestmark = pytest.mark.timeout(120)

VOCAB = 1000
STOP = common_pb2.FINISH_REASON_STOP
LENGTH = common_pb2.FINISH_REASON_LENGTH
ABORT = common_pb2.FINISH_REASON_ABORT


def _metric(s, name: str) -> float:
    return s.scheduler.metrics.registry.get_sample_value(name, {"model": "SmolLM2-135M-Instruct"})


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 90))


async def _first_tokens(call, num: int = 1) -> list[int]:
    tokens = []
    async for response in call:
        tokens.extend(response.token_ids)
        if len(tokens) >= num:
            return tokens
    raise AssertionError("stream ended early")


@pytest.mark.parametrize("num_scheduler_steps", [1, 4])
def test_concurrent_submits_finish_with_the_right_tokens(num_scheduler_steps):
    async def body():
        worker = {"num_blocks": 64, "block_size": 4, "eos_token_ids": (7,)}
        async with stack(worker_kw=worker, num_scheduler_steps=num_scheduler_steps) as s:
            system = list(range(100, 112))  # a shared "system prompt" of three full blocks
            prompts = [system + [200 + i] * (1 + i % 5) for i in range(12)]
            requests = [
                submit_request(f"r{i}", p, max_tokens=5 + i, ignore_eos=i % 2 == 0) for i, p in enumerate(prompts)
            ]
            results = await asyncio.gather(*(collect(s.stub, r) for r in requests))
            for i, (tokens, finish, responses) in enumerate(results):
                expected = generate(prompts[i], 5 + i, VOCAB, stop_ids=() if i % 2 == 0 else (7,))
                assert tokens == expected, i
                assert finish == (STOP if expected[-1] == 7 and i % 2 else LENGTH)
                assert responses[0].num_prompt_tokens == len(prompts[i]) and not responses[0].token_ids
            stats = await s.wait_for(lambda st: st.num_running == 0 and st.num_waiting == 0)
            assert stats.num_blocks_used == 0 and stats.kv_cache_usage == 0
            assert stats.num_cached_free_blocks > 0
            assert stats.prefix_cache_queries == sum(len(p) for p in prompts)
            assert stats.prefix_cache_hits >= len(system)  # later requests found the shared system prompt
            assert _metric(s, "kvgrid_prefix_cache_queries_total") == stats.prefix_cache_queries
            assert _metric(s, "kvgrid_prefix_cache_hits_total") == stats.prefix_cache_hits
            assert _metric(s, "kvgrid_kv_blocks_total") == 64
            assert _metric(s, "kvgrid_num_requests_running") == 0 and _metric(s, "kvgrid_kv_cache_usage_ratio") == 0
            # A plan of several steps counts as that many steps in the per-step histograms.
            assert _metric(s, "kvgrid_step_batch_tokens_count") == stats.num_steps == s.worker.worker.num_steps
            assert _metric(s, "kvgrid_schedule_seconds_count") == stats.num_steps
            assert (num_scheduler_steps > 1) == (s.worker.worker.num_multi_step_plans > 0)
            assert s.worker.worker.errors == []

    run(body())


def test_a_preempted_request_produces_the_same_tokens():
    async def body():
        # 12 blocks of 4 tokens: three requests growing to 8 + 24 tokens each cannot all stay resident.
        async with stack(worker_kw={"num_blocks": 12, "block_size": 4}) as s:
            prompts = [[300 + 10 * i + j for j in range(8)] for i in range(3)]
            requests = [submit_request(f"p{i}", p, max_tokens=24, ignore_eos=True) for i, p in enumerate(prompts)]
            results = await asyncio.gather(*(collect(s.stub, r) for r in requests))
            for prompt, (tokens, finish, _) in zip(prompts, results, strict=True):
                assert tokens == generate(prompt, 24, VOCAB)
                assert finish == LENGTH
            stats = await s.stats()
            assert stats.num_preemptions > 0
            assert stats.num_blocks_used == 0
            assert _metric(s, "kvgrid_num_preemptions_total") == stats.num_preemptions
            assert s.worker.worker.errors == []

    run(body())


def test_logprobs_and_cached_token_counts_reach_the_caller():
    async def body():
        async with stack(worker_kw={"block_size": 4}) as s:
            prompt = list(range(1, 10))
            await collect(s.stub, submit_request("a", prompt, max_tokens=3))
            tokens, _, responses = await collect(s.stub, submit_request("b", prompt, max_tokens=3, logprobs=1))
            assert [lp.token_id for r in responses for lp in r.logprobs] == tokens
            assert responses[-1].num_cached_tokens == 8  # two full blocks; the last prompt token is recomputed

    run(body())


def test_a_lost_worker_s_requests_resume_on_the_next_worker_without_a_missing_or_repeated_token():
    async def body():
        async with stack(worker_kw={"num_blocks": 32, "block_size": 4, "step_delay": 0.01}) as s:
            prompts = {f"k{i}": [1, 2, 3, i] for i in range(3)}
            calls = {
                rid: s.stub.Submit(submit_request(rid, p, max_tokens=40, ignore_eos=True)) for rid, p in prompts.items()
            }
            before = {rid: await _first_tokens(call, 3) for rid, call in calls.items()}
            port = s.worker.port
            await s.worker.stop()
            stats = await s.wait_for(lambda st: not st.worker_ready)
            assert stats.num_waiting == 3  # parked, not failed
            assert await s.health() == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:  # no worker: nothing to size a new request against
                await collect(s.stub, submit_request("early", [1, 2]))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

            # The worker comes back on the same address, with a smaller pool: a fresh handshake sizes it.
            s.worker = await start_fake_worker(port=port, num_blocks=20, block_size=4)
            for rid, call in calls.items():
                rest = [t async for response in call for t in response.token_ids]
                assert before[rid] + rest == generate(prompts[rid], 40, VOCAB), rid
            stats = await s.wait_for(lambda st: st.worker_ready and st.num_blocks_used == 0)
            assert stats.num_blocks_total == 20 and stats.num_running == 0 and stats.num_waiting == 0
            assert await s.health() == SERVING
            assert s.worker.worker.num_handshakes == 1 and s.worker.worker.errors == []

    run(body())


def test_requests_fail_unavailable_when_no_worker_returns_in_time_or_cannot_fit_the_new_pool():
    async def body():
        worker_kw = {"num_blocks": 32, "block_size": 4, "step_delay": 0.01}
        async with stack(worker_kw=worker_kw, worker_reconnect_timeout=0.5) as s:
            call = s.stub.Submit(submit_request("t", [1, 2, 3], max_tokens=100, ignore_eos=True))
            await _first_tokens(call)
            port = s.worker.port
            await s.worker.stop()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "the worker was lost and no worker came back" in e.value.details()
            assert (await s.stats()).num_waiting == 0

            # A request whose tokens outgrow the next worker's whole pool fails with RESOURCE_EXHAUSTED.
            s.worker = await start_fake_worker(port=port, **worker_kw)
            await s.wait_for(lambda st: st.worker_ready)
            call = s.stub.Submit(submit_request("big", [1] * 20, max_tokens=100, ignore_eos=True))
            await _first_tokens(call)
            await s.worker.stop()
            await s.wait_for(lambda st: not st.worker_ready)
            s.worker = await start_fake_worker(port=port, num_blocks=4, block_size=4)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "new worker" in e.value.details()
            stats = await s.wait_for(lambda st: st.worker_ready)
            assert stats.num_blocks_used == 0 and stats.num_waiting == 0 and stats.num_running == 0

    run(body())


def test_abort_mid_stream_frees_the_blocks():
    async def body():
        async with stack(worker_kw={"block_size": 4, "step_delay": 0.01}) as s:
            call = s.stub.Submit(submit_request("ab", list(range(1, 30)), max_tokens=500, ignore_eos=True))
            await _first_tokens(call, 2)
            assert (await s.stats()).num_blocks_used > 0
            reply = await s.stub.Abort(scheduler_pb2.AbortRequest(request_id="ab"))
            assert reply.found
            last = None
            async for response in call:
                last = response
            assert last.finish_reason == ABORT
            stats = await s.stats()
            assert stats.num_blocks_used == 0 and stats.num_running == 0
            assert not (await s.stub.Abort(scheduler_pb2.AbortRequest(request_id="ab"))).found
            await asyncio.sleep(0.05)
            assert "ab" not in s.worker.worker.seqs  # the worker was told to drop it
            assert s.worker.worker.errors == []

    run(body())


def test_cancelling_submit_aborts_the_request():
    async def body():
        async with stack(worker_kw={"block_size": 4, "step_delay": 0.01}) as s:
            call = s.stub.Submit(submit_request("gone", list(range(1, 20)), max_tokens=500, ignore_eos=True))
            await _first_tokens(call)
            call.cancel()
            await s.wait_for(lambda st: st.num_running == 0 and st.num_blocks_used == 0)
            # The id is free again.
            tokens, _, _ = await collect(s.stub, submit_request("gone", [5, 6], max_tokens=2))
            assert tokens == generate([5, 6], 2, VOCAB)

    run(body())


def test_bad_input_is_refused_and_never_queued():
    async def body():
        async with stack(
            worker_kw={"num_blocks": 8, "block_size": 4, "max_model_len": 64}, max_waiting_requests=1
        ) as s:

            async def status(request):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await collect(s.stub, request)
                return e.value.code(), e.value.details()

            code, details = await status(submit_request("x", []))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in details
            code, details = await status(submit_request("x", [VOCAB]))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "vocabulary" in details
            code, details = await status(submit_request("x", [1] * 64))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "maximum model length" in details
            code, details = await status(submit_request("x", [1] * 40))  # 8 blocks of 4 hold 32 tokens
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "blocks" in details
            stats = await s.stats()
            assert stats.num_waiting == 0 and stats.num_running == 0

            # Hold the worker: the first request runs (its step is in flight), the second waits.
            s.worker.worker.gate.clear()
            first = s.stub.Submit(submit_request("dup", [1, 2], max_tokens=2))
            await first.read()
            await s.wait_for(lambda st: st.num_running == 1)
            code, details = await status(submit_request("dup", [3]))
            assert code == grpc.StatusCode.ALREADY_EXISTS and "dup" in details
            second = s.stub.Submit(submit_request("second", [1, 2], max_tokens=2))
            await second.read()
            await s.wait_for(lambda st: st.num_waiting == 1)
            code, details = await status(submit_request("third", [3]))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue" in details
            s.worker.worker.gate.set()
            for call in (first, second):
                tokens = []
                while (response := await call.read()) is not grpc.aio.EOF:
                    tokens.extend(response.token_ids)
                assert tokens == generate([1, 2], 2, VOCAB)

    run(body())


def test_no_worker_means_unavailable_and_worker_info_waits_for_the_handshake():
    async def body():
        probe = await start_fake_worker()
        addr = probe.addr
        await probe.stop()  # a port nobody listens on now
        server = await start(make_config(addr, 16))
        channel = insecure_channel(f"127.0.0.1:{server.port}")
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(stub, submit_request("a", [1, 2]))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.GetWorkerInfo(scheduler_pb2.GetWorkerInfoRequest())
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert not (await stub.GetStats(scheduler_pb2.GetStatsRequest())).worker_ready

            worker = await start_fake_worker(
                port=int(addr.rsplit(":", 1)[1]), tokenizer_files={"tokenizer.json": b"{}"}
            )
            for _ in range(500):
                if (await stub.GetStats(scheduler_pb2.GetStatsRequest())).worker_ready:
                    break
                await asyncio.sleep(0.02)
            info = await stub.GetWorkerInfo(scheduler_pb2.GetWorkerInfoRequest())
            assert info.worker_id == "fake-worker" and info.tokenizer_files["tokenizer.json"] == b"{}"
            await worker.stop()
        finally:
            await channel.close()
            await server.stop(grace=0.5)

    run(body())


@pytest.mark.parametrize(
    ("worker_kw", "model", "why"),
    [
        ({"block_size": 8}, ModelConfig(), "block size"),
        ({"model": "other-model"}, ModelConfig(served_model_name="SmolLM2-135M-Instruct"), "model"),
    ],
)
def test_a_mismatched_worker_is_refused(worker_kw, model, why):
    async def body():
        worker = await start_fake_worker(**worker_kw)
        server = await start(make_config(worker.addr, 16, model))
        try:
            for _ in range(500):
                if worker.worker.num_handshakes >= 2:  # refused, then retried
                    break
                await asyncio.sleep(0.02)
            assert worker.worker.num_handshakes >= 2, why
            assert not server.engine.ready and worker.worker.num_steps == 0
        finally:
            await server.stop(grace=0.5)
            await worker.stop()

    run(body())


def test_an_unchecked_model_name_is_accepted():
    async def body():
        # No --model / --served-model-name: any model name is fine.
        async with stack(worker_kw={"model": "whatever"}) as s:
            tokens, _, _ = await collect(s.stub, submit_request("a", [1], max_tokens=2))
            assert tokens == generate([1], 2, VOCAB)

    run(body())


def test_graceful_stop_fails_in_flight_requests_with_unavailable():
    async def body():
        async with stack(worker_kw={"step_delay": 0.01}) as s:
            call = s.stub.Submit(submit_request("g", [1, 2, 3], max_tokens=500, ignore_eos=True))
            await _first_tokens(call)
            await s.scheduler.engine.stop()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in call:
                    pass
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()

    run(body())


def test_a_draining_scheduler_finishes_live_requests_and_refuses_new_ones():
    async def body():
        async with stack(worker_kw={"step_delay": 0.01}) as s:
            call = s.stub.Submit(submit_request("d", [1, 2, 3], max_tokens=30, ignore_eos=True))
            first = await _first_tokens(call)
            stopping = asyncio.create_task(s.scheduler.stop(grace=60))
            await asyncio.sleep(0.05)
            assert await s.health() == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await collect(s.stub, submit_request("late", [1, 2]))
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in e.value.details()
            rest = [t async for response in call for t in response.token_ids]
            assert first + rest == generate([1, 2, 3], 30, VOCAB)
            await stopping

    run(body())


def test_a_worker_lost_while_idle_is_noticed_without_a_request():
    async def body():
        async with stack() as s:
            await collect(s.stub, submit_request("a", [1, 2], max_tokens=2))
            await s.worker.stop()
            await s.wait_for(lambda st: not st.worker_ready)
            assert await s.health() == NOT_SERVING

    run(body())
