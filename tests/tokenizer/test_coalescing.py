"""Delivery under load: what queued up for a slow client goes out as one response; a lone token is never held;
the scheduler link lets the scheduler run ahead by one small window only."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvgrid.v1 import common_pb2, scheduler_pb2
from services.common.server import CHANNEL_OPTIONS
from services.tokenizer.frontdoor import EngineRequest
from services.tokenizer.generation import generate
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.openai.choices import Pipeline, run_choices
from services.tokenizer.openai.prepare import Choice
from services.tokenizer.request_handle import RequestHandle
from services.tokenizer.request_metrics import RequestMetrics
from services.tokenizer.text_tokenizer import TextTokenizer
from services.tokenizer.upstream import LINK_OPTIONS
from services.tokenizer.validation import ModelLimits
from tests.tokenizer.conftest import MAX_MODEL_LEN, VOCAB_SIZE

pytestmark = pytest.mark.timeout(60)
LIMITS = ModelLimits(max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE)


class FakeEngine:
    """Submits make handles the test feeds by hand, as the engine client's dispatch would."""

    def __init__(self):
        self.handles: dict[str, RequestHandle] = {}
        self.aborted: list[str] = []
        self.at_finish: dict[str, bool] = {}

    async def submit(self, request_id, prompt_ids, sampling, trace_context, deliver_at_finish=False) -> RequestHandle:
        self.handles[request_id] = RequestHandle(self, request_id)
        self.at_finish[request_id] = deliver_at_finish
        return self.handles[request_id]

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def feed(self, request_id: str, token_ids: list[int], finish: int = 0) -> None:
        handle = self.handles[request_id]
        delta = scheduler_pb2.RequestDelta(request_id=request_id, token_ids=token_ids, finish_reason=finish)
        delta.logprobs.extend(common_pb2.TokenLogprob(token_id=t, logprob=-1.0) for t in token_ids)
        if finish:
            handle.done_upstream = True
        handle.deliver(delta)
        if finish:
            handle.end()


@pytest.fixture(scope="module")
def tok(smollm) -> TextTokenizer:
    return TextTokenizer.from_files(smollm.files)


def ids_of(smollm, text: str) -> list[int]:
    return smollm.hf(text, add_special_tokens=False)["input_ids"]


def test_queued_deltas_go_out_as_one_response_and_a_lone_one_at_once(tok, smollm):
    ids = ids_of(smollm, "The quick brown fox jumps")
    assert len(ids) >= 5

    async def scenario():
        engine = FakeEngine()
        sampling = common_pb2.SamplingParams(max_tokens=len(ids), logprobs=0)
        stream = generate(engine, tok, EngineRequest("r1", [1, 2, 3], sampling, len(ids)))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)  # submitted; the call now waits for output
        for t in ids[:3]:  # three steps arrive before the call gets to write
            engine.feed("r1", [t])
        merged = await first
        engine.feed("r1", [ids[3]])
        lone = await anext(stream)  # not held back to wait for more
        engine.feed("r1", [ids[4]])
        engine.feed("r1", [], finish=common_pb2.FINISH_REASON_LENGTH)
        last = await anext(stream)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return merged, lone, last

    merged, lone, last = asyncio.run(scenario())
    assert list(merged.token_ids) == ids[:3] and [lp.token_id for lp in merged.logprobs] == ids[:3]
    assert merged.text == tok.decode(ids[:3]) and not merged.finish_reason
    assert list(lone.token_ids) == [ids[3]]
    assert list(last.token_ids) == [ids[4]] and last.finish_reason == "length"
    assert last.usage.completion_tokens == 5
    assert merged.text + lone.text + last.text == tok.decode(ids[:5])


def test_a_stop_string_inside_queued_deltas_cuts_exactly_and_aborts(tok, smollm):
    ids = ids_of(smollm, "one two END three four")
    num_kept = next(k for k in range(1, len(ids) + 1) if "END" in tok.decode(ids[:k]))

    async def scenario():
        engine = FakeEngine()
        sampling = common_pb2.SamplingParams(max_tokens=32, stop=["END"])
        stream = generate(engine, tok, EngineRequest("r2", [1], sampling, 32))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        for t in ids:
            engine.feed("r2", [t])
        out = await first
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return out, engine.aborted

    out, aborted = asyncio.run(scenario())
    assert out.text == "one two " and out.finish_reason == "stop"
    assert list(out.token_ids) == ids[:num_kept] and out.usage.completion_tokens == num_kept
    assert aborted == ["r2"]  # freed upstream as soon as the stop string was seen


def test_openai_choices_merge_what_queued_per_choice_in_order(tok, smollm):
    ids = ids_of(smollm, "alpha beta gamma delta")

    async def scenario():
        engine = FakeEngine()
        sampling = common_pb2.SamplingParams(max_tokens=16)
        choices = [Choice(i, 0, EngineRequest(f"c-{i}", [1, 2], sampling, 16), leader=True) for i in range(2)]
        deltas = run_choices(Pipeline(engine, tok, TokenizerMetrics("test-model")), choices)
        first = asyncio.ensure_future(anext(deltas))
        while len(engine.handles) < 2:
            await asyncio.sleep(0)
        engine.feed("c-0", [ids[0]])
        out = [await first]  # alone: not held for its sibling or for more
        for t in ids[1:]:
            engine.feed("c-0", [t])
            engine.feed("c-1", [t])
        for _ in range(3):  # the choices' tasks queue their deltas while this consumer waits
            await asyncio.sleep(0)
        out.append(await anext(deltas))
        out.append(await anext(deltas))
        engine.feed("c-0", [], finish=common_pb2.FINISH_REASON_LENGTH)
        engine.feed("c-1", [], finish=common_pb2.FINISH_REASON_LENGTH)
        out += [item async for item in deltas]
        return out

    out = asyncio.run(scenario())
    assert out[0][0] == 0 and list(out[0][1].token_ids) == ids[:1]
    assert {index: list(d.token_ids) for index, d in out[1:3]} == {0: ids[1:], 1: ids[1:]}
    assert [d.finish_reason for _, d in out[3:]] == ["length", "length"]


@pytest.mark.parametrize("held", [False, True], ids=["every-step", "held-to-the-finish"])
def test_an_answer_sent_once_wakes_its_call_once_and_times_each_token_as_it_came(tok, smollm, held):
    """The scheduler sends the deltas step by step, or (``deliver_at_finish``) the first token, then the rest with
    the finish: either way each token after the first counts one inter-token latency."""
    ids = ids_of(smollm, "The quick brown fox jumps")
    metrics = TokenizerMetrics("final-only")
    deltas = [ids[:1], ids[1:]] if held else [[t] for t in ids]

    async def scenario():
        engine = FakeEngine()
        sampling = common_pb2.SamplingParams(max_tokens=len(ids))
        with RequestMetrics(metrics, "r3") as tracked:
            request = EngineRequest("r3", [1, 2, 3], sampling, len(ids))
            stream = generate(engine, tok, request, tracked=tracked, final_only=True)
            first = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0)
            woken = []
            for delta in deltas[:-1]:
                engine.feed("r3", delta)
                for _ in range(3):  # loop turns enough for a woken call to take its delta
                    await asyncio.sleep(0)
                woken.append(first.done())
            engine.feed("r3", deltas[-1], finish=common_pb2.FINISH_REASON_LENGTH)
            out = await first
            with pytest.raises(StopAsyncIteration):
                await anext(stream)
            tracked.finish(out.finish_reason)
        return woken, out, engine.at_finish["r3"]

    woken, out, at_finish = asyncio.run(scenario())
    assert at_finish  # no stop strings: the scheduler may hold the tokens after the first
    assert not any(woken)  # no wake-up per step for a call that answers at the end
    assert list(out.token_ids) == ids and out.text == tok.decode(ids) and out.finish_reason == "length"
    assert out.usage.completion_tokens == len(ids)
    labels = {"model": "final-only"}
    # Each delta timed as it was processed, as for a streamed call: one first token, then a gap per later token.
    assert metrics.registry.get_sample_value("kvgrid_time_to_first_token_seconds_count", labels) == 1
    assert metrics.registry.get_sample_value("kvgrid_inter_token_latency_seconds_count", labels) == len(ids) - 1


def test_a_stop_string_ends_an_answer_sent_once(tok, smollm):
    ids = ids_of(smollm, "one two END three four")

    async def scenario():
        engine = FakeEngine()
        sampling = common_pb2.SamplingParams(max_tokens=32, stop=["END"])
        stream = generate(engine, tok, EngineRequest("r4", [1], sampling, 32), final_only=True)
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        for t in ids:  # the scheduler sends no finish: the stop string's abort removed the request there
            engine.feed("r4", [t])
        return await asyncio.wait_for(first, 5), engine.aborted, engine.at_finish["r4"]

    out, aborted, at_finish = asyncio.run(scenario())
    assert out.text == "one two " and out.finish_reason == "stop" and aborted == ["r4"]
    assert not at_finish  # stop strings are matched here as the tokens come: none may be held upstream


def test_choices_answered_once_come_out_whole_and_siblings_still_start_early(tok, smollm):
    ids = ids_of(smollm, "alpha beta gamma delta")
    sampling = common_pb2.SamplingParams(max_tokens=16)

    async def scenario(leaders: list[bool]):
        engine = FakeEngine()
        choices = [Choice(i, 0, EngineRequest(f"c-{i}", [1, 2], sampling, 16), leader=lead)
                   for i, lead in enumerate(leaders)]  # fmt: skip
        deltas = run_choices(Pipeline(engine, tok, TokenizerMetrics("test-model")), choices, final_only=True)
        collected = asyncio.ensure_future(_all(deltas))
        while "c-0" not in engine.handles:
            await asyncio.sleep(0)
        engine.feed("c-0", [ids[0]])
        for _ in range(5):
            await asyncio.sleep(0)
        started = sorted(engine.handles)  # a sibling waits for its leader's first output, not for its end
        for name in started:
            for t in ids[1:] if name == "c-0" else ids:
                engine.feed(name, [t])
            engine.feed(name, [], finish=common_pb2.FINISH_REASON_LENGTH)
        return started, await collected

    started, out = asyncio.run(scenario([True, True]))
    assert started == ["c-0", "c-1"]
    assert sorted((index, list(d.token_ids), d.finish_reason) for index, d in out) == [
        (0, ids, "length"), (1, ids, "length")
    ]  # fmt: skip
    started, out = asyncio.run(scenario([True, False]))  # as streamed, then: the leader's first token alone
    assert started == ["c-0", "c-1"]
    assert [(index, list(d.token_ids)) for index, d in out if index == 0][0] == (0, ids[:1])
    assert {index: sum((list(d.token_ids) for i, d in out if i == index), []) for index, _ in out} == {0: ids, 1: ids}


async def _all(deltas) -> list:
    return [item async for item in deltas]


async def _run_ahead_kb(options: list, num_read: int = 3000, message_bytes: int = 1000) -> int:
    """KB a server streaming as fast as it may has written beyond what a paused reader took."""
    written = 0

    async def stream(request, context):
        nonlocal written
        while True:
            await context.write(b"x" * message_bytes)
            written += 1

    server = grpc.aio.server()
    handler = grpc.unary_stream_rpc_method_handler(stream)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {"S": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
            call = channel.unary_stream("/t.T/S")(b"")
            for _ in range(num_read):  # a busy stream: BDP probing would grow the window here
                await call.read()
            await asyncio.sleep(0.5)  # the reader falls behind
            call.cancel()
            return (written - num_read) * message_bytes // 1024
    finally:
        await server.stop(0)


def test_the_scheduler_link_lets_the_scheduler_run_ahead_by_one_small_window():
    link = asyncio.run(_run_ahead_kb(CHANNEL_OPTIONS + LINK_OPTIONS))
    default = asyncio.run(_run_ahead_kb(CHANNEL_OPTIONS))
    # About two step messages of one-token deltas for 256 requests (the 64 KB window of before measured 80 KB).
    assert link <= 48, f"the scheduler could run {link} KB ahead of a stalled frontend"
    assert default > 4 * link  # what the options prevent: megabytes of one-token steps queued
