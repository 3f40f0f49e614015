"""Scheduler.Connect over real gRPC against the fake worker: one stream per frontend, one message per step."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict

import grpc
import pytest

from kvgrid.v1 import common_pb2, scheduler_pb2
from tests.scheduler.fake_worker import generate
from tests.scheduler.harness import stack, submit_request

pytestmark = pytest.mark.timeout(180)

VOCAB = 1000
LENGTH = common_pb2.FINISH_REASON_LENGTH
STOP = common_pb2.FINISH_REASON_STOP
ABORT = common_pb2.FINISH_REASON_ABORT


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 150))


class Frontend:
    """One Connect stream, read in the background: tokens, finish reasons and errors per request."""

    def __init__(self, stub):
        self.call = stub.Connect()
        self.messages: list[scheduler_pb2.SchedulerMessage] = []
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finish: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.call:
            self.messages.append(message)
            for delta in message.deltas:
                self.tokens[delta.request_id].extend(delta.token_ids)
                if delta.error_code:
                    self.errors[delta.request_id] = delta.error_code
                if delta.finish_reason:
                    self.finish[delta.request_id] = delta.finish_reason
            self._changed.set()

    async def send(self, submits=(), aborts=()) -> None:
        await self.call.write(scheduler_pb2.FrontendMessage(submits=submits, aborts=aborts))

    async def wait(self, predicate, timeout: float = 60.0) -> None:
        async def until():
            while not predicate():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(until(), timeout)

    def ended(self, request_ids) -> bool:
        return all(rid in self.finish or rid in self.errors for rid in request_ids)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_two_frontends_interleave_and_each_gets_one_message_per_step_with_only_its_own_deltas(async_scheduling):
    async def body():
        async with stack(worker_kw={"num_blocks": 256, "block_size": 4}, async_scheduling=async_scheduling) as s:
            a, b = Frontend(s.stub), Frontend(s.stub)
            prompts = {f"{name}{i}": [i + 1, 2 * i + 3, 7] for i in range(12) for name in "ab"}
            for i in range(12):  # interleaved arrivals
                await a.send([submit_request(f"a{i}", prompts[f"a{i}"], max_tokens=10 + i)])
                await b.send([submit_request(f"b{i}", prompts[f"b{i}"], max_tokens=20 - i)])
            await a.wait(lambda: a.ended([f"a{i}" for i in range(12)]))
            await b.wait(lambda: b.ended([f"b{i}" for i in range(12)]))
            for frontend, name in ((a, "a"), (b, "b")):
                assert {d.request_id[0] for m in frontend.messages for d in m.deltas} == {name}
                for m in frontend.messages:  # one entry per request per message
                    assert len({d.request_id for d in m.deltas}) == len(m.deltas)
                for i in range(12):
                    rid = f"{name}{i}"
                    max_tokens = 10 + i if name == "a" else 20 - i
                    assert frontend.tokens[rid] == generate(prompts[rid], max_tokens, VOCAB) and not frontend.errors
                    assert frontend.finish[rid] == LENGTH
            stats = await s.stats()
            assert len(a.messages) <= stats.num_steps and len(b.messages) <= stats.num_steps
            # Batched per step: far fewer messages than tokens.
            assert len(a.messages) < sum(len(t) for t in a.tokens.values()) / 3
            a.call.cancel()
            b.call.cancel()

    run(body())


def test_a_request_delivered_at_finish_gets_its_first_token_at_once_and_the_rest_with_its_finish():
    async def body():
        async with stack(worker_kw={"num_blocks": 256, "block_size": 4, "step_delay": 0.01}) as s:
            f = Frontend(s.stub)
            held = submit_request("held", [3, 4, 5], max_tokens=12, logprobs=1)
            held.deliver_at_finish = True
            await f.send([held, submit_request("plain", [3, 4, 5], max_tokens=12)])
            await f.wait(lambda: f.ended(["held", "plain"]))
            deltas = [d for m in f.messages for d in m.deltas if d.request_id == "held"]
            assert [len(d.token_ids) for d in deltas] == [1, 11] and deltas[-1].finish_reason == LENGTH
            assert [len(d.logprobs) for d in deltas] == [1, 11]  # the logprobs travel with their tokens
            assert f.tokens["held"] == f.tokens["plain"] == generate([3, 4, 5], 12, VOCAB)
            # The other request of the same stream still gets its tokens step by step.
            assert len([d for m in f.messages for d in m.deltas if d.request_id == "plain" and d.token_ids]) > 2

            # An abort sends what was held, then the abort.
            doomed = submit_request("doomed", [6, 7], max_tokens=400)
            doomed.deliver_at_finish = True
            await f.send([doomed])
            await f.wait(lambda: f.tokens["doomed"])
            steps = (await s.stats()).num_steps
            await s.wait_for(lambda st: st.num_steps >= steps + 4)
            assert len(f.tokens["doomed"]) == 1  # the rest is held
            await f.send(aborts=["doomed"])
            await f.wait(lambda: f.ended(["doomed"]))
            assert f.finish["doomed"] == ABORT and len(f.tokens["doomed"]) >= 4
            assert f.tokens["doomed"] == generate([6, 7], len(f.tokens["doomed"]), VOCAB)
            f.call.cancel()

    run(body())


def test_a_broken_frontend_stream_aborts_its_requests_and_spares_the_others():
    async def body():
        async with stack(worker_kw={"num_blocks": 128, "block_size": 4, "step_delay": 0.01}) as s:
            doomed, other = Frontend(s.stub), Frontend(s.stub)
            await doomed.send([submit_request(f"d{i}", [i + 1, 5], max_tokens=400) for i in range(6)])
            await other.send([submit_request(f"o{i}", [i + 9, 4], max_tokens=40) for i in range(3)])
            await doomed.wait(lambda: all(len(doomed.tokens[f"d{i}"]) >= 3 for i in range(6)))
            doomed.call.cancel()
            await s.wait_for(lambda st: st.num_running == 3)  # only the other frontend's requests are left
            await other.wait(lambda: other.ended([f"o{i}" for i in range(3)]))
            for i in range(3):
                assert other.tokens[f"o{i}"] == generate([i + 9, 4], 40, VOCAB) and other.finish[f"o{i}"] == LENGTH
            await s.wait_for(lambda st: st.num_running == 0 and st.num_waiting == 0 and st.num_blocks_used == 0)
            # The scheduler is unharmed: a new frontend is served, and may reuse the dead stream's ids.
            again = Frontend(s.stub)
            await again.send([submit_request("d0", [1, 5], max_tokens=8)])
            await again.wait(lambda: again.ended(["d0"]))
            assert again.tokens["d0"] == generate([1, 5], 8, VOCAB) and again.finish["d0"] == LENGTH
            again.call.cancel()

    run(body())


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("max_tokens", [1, 3])
def test_aborting_a_request_whose_last_token_is_in_flight_streams_no_token_after_the_abort(
    async_scheduling, max_tokens
):
    async def body():
        # Each step takes 0.5 s in the worker: the abort lands while the step with the last token runs.
        worker_kw = {"num_blocks": 32, "block_size": 4, "step_delay": 0.5}
        async with stack(worker_kw=worker_kw, async_scheduling=async_scheduling) as s:
            f = Frontend(s.stub)
            await f.send([submit_request("r", [3, 4, 5], max_tokens=max_tokens)])
            if max_tokens > 1:
                await f.wait(lambda: len(f.tokens["r"]) >= max_tokens - 1)
            else:
                await s.wait_for(lambda st: st.num_running == 1)
            await f.send(aborts=["r"])
            await f.wait(lambda: "r" in f.finish)
            assert f.finish["r"] == ABORT and len(f.tokens["r"]) < max_tokens
            assert f.tokens["r"] == generate([3, 4, 5], max_tokens, VOCAB)[: len(f.tokens["r"])]
            await s.wait_for(lambda st: st.num_running == 0 and st.num_blocks_used == 0)
            await asyncio.sleep(0.6)  # whatever the worker still answers for "r" must not reach the frontend
            assert len(f.tokens["r"]) < max_tokens and not f.errors
            # The worker was told to drop it once the next step ran.
            await f.send([submit_request("next", [9, 9], max_tokens=2)])
            await f.wait(lambda: "next" in f.finish)
            assert "r" not in s.worker.worker.seqs
            f.call.cancel()

    run(body())


def test_errors_come_back_per_request_with_their_code_and_the_stream_lives_on():
    async def body():
        worker_kw = {"num_blocks": 32, "block_size": 4, "vocab_size": 100, "step_delay": 0.05}
        async with stack(worker_kw=worker_kw) as s:
            f, other = Frontend(s.stub), Frontend(s.stub)
            await f.send([submit_request("bad", [5, 500]), submit_request("ok", [5, 6], max_tokens=8)])
            # Written is not read: the scheduler may take the two streams' messages in either order. Once "bad"
            # has its error, the message that also submits "ok" was taken, and "ok" runs for 8 steps of 50 ms.
            await f.wait(lambda: "bad" in f.errors)
            await other.send([submit_request("ok", [5, 6], max_tokens=2)])  # the id is live (on another stream)
            await other.wait(lambda: other.ended(["ok"]))
            await f.wait(lambda: f.ended(["bad", "ok"]))
            assert f.errors["bad"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert f.finish["ok"] == LENGTH and f.tokens["ok"] == generate([5, 6], 8, 100) and "ok" not in f.errors
            assert other.errors == {"ok": grpc.StatusCode.ALREADY_EXISTS.value[0]} and not other.tokens["ok"]
            f.call.cancel()
            other.call.cancel()

    run(body())


@pytest.mark.parametrize("num_blocks", [40, 600], ids=["preempting", "roomy"])
def test_async_scheduling_gives_the_same_outputs_as_sync_over_hundreds_of_mixed_requests(num_blocks):
    rng = random.Random(num_blocks)
    system = [rng.randrange(3, 50) for _ in range(12)]
    requests = []
    for i in range(300):
        prompt = (system if i % 3 else []) + [rng.randrange(3, 50) for _ in range(rng.randint(1, 10))]
        max_tokens = rng.randint(1, 30)
        # min_tokens <= max_tokens, as the frontend sends it (the scheduler refuses more, as the frontend does)
        sampling = dict(max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 2]), max_tokens), ignore_eos=i % 5 == 0)
        requests.append(submit_request(f"m{i}", prompt, **sampling))
    aborted = {f"m{i}" for i in rng.sample(range(300), 15)}

    async def outputs(async_scheduling: bool):
        worker_kw = {"num_blocks": num_blocks, "block_size": 4, "vocab_size": 50, "eos_token_ids": (0, 1, 2)}
        async with stack(worker_kw=worker_kw, async_scheduling=async_scheduling, max_num_seqs=32) as s:
            f = Frontend(s.stub)
            for i in range(0, 300, 20):
                await f.send(requests[i : i + 20])
                await f.send(aborts=sorted(rid for rid in aborted if int(rid[1:]) < i))
                await asyncio.sleep(0.005)
            await f.send(aborts=sorted(aborted))
            await f.wait(lambda: f.ended([r.request_id for r in requests]), timeout=120)
            await s.wait_for(lambda st: st.num_running == 0 and st.num_blocks_used == 0)
            stats = await s.stats()
            assert not f.errors and not s.worker.worker.errors
            f.call.cancel()
            return dict(f.tokens), dict(f.finish), stats.num_preemptions

    (sync_tokens, sync_finish, sync_pre), (async_tokens, async_finish, async_pre) = (
        run(outputs(False)),
        run(outputs(True)),
    )
    if num_blocks == 40:
        assert sync_pre > 0 and async_pre > 0
    for r in requests:
        rid = r.request_id
        stop = dict(
            max_tokens=r.sampling.max_tokens, min_tokens=r.sampling.min_tokens, ignore_eos=r.sampling.ignore_eos
        )
        expected = _reference(list(r.prompt_token_ids), **stop)
        for tokens, finish in ((sync_tokens, sync_finish), (async_tokens, async_finish)):
            got = tokens.get(rid, [])
            if finish[rid] == ABORT:
                assert rid in aborted and got == expected[: len(got)], rid
            else:
                assert got == expected, rid
                assert finish[rid] == (STOP if expected[-1] in (0, 1, 2) and not stop["ignore_eos"] else LENGTH), rid
    both = [r.request_id for r in requests if sync_finish[r.request_id] != ABORT != async_finish[r.request_id]]
    assert len(both) >= 285
    assert [async_tokens.get(rid) for rid in both] == [sync_tokens.get(rid) for rid in both]


def _reference(prompt: list[int], max_tokens: int, min_tokens: int, ignore_eos: bool) -> list[int]:
    tokens, out = list(prompt), []
    while len(out) < max_tokens:
        out += generate(tokens, 1, 50)
        tokens.append(out[-1])
        if not ignore_eos and len(out) >= min_tokens and out[-1] in (0, 1, 2):
            break
    return out
