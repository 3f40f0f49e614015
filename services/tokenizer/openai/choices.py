"""The choices of one OpenAI request (n per prompt) run concurrently through the frontend pipeline.

The n choices of a prompt share its KV blocks through the prefix cache: the first one is submitted alone,
and its siblings once it has produced output, when its prompt's full blocks are computed and cached at
the scheduler. Closing the merged stream (a client that went away) cancels every choice, which aborts
each upstream and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvgrid.v1 import generate_pb2
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.generation import generate
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.openai.prepare import Choice
from services.tokenizer.output import merge
from services.tokenizer.request_metrics import RequestMetrics
from services.tokenizer.text_tokenizer import TextTokenizer


@dataclass(slots=True)
class Pipeline:
    """What a choice needs to run: the engine client, the model's tokenizer, the metrics."""

    engine: EngineClient
    tokenizer: TextTokenizer
    metrics: TokenizerMetrics
    parent_context: object = None


async def run_choices(
    pipe: Pipeline, choices: list[Choice], final_only: bool = False
) -> AsyncIterator[tuple[int, generate_pb2.GenerateResponse]]:
    """(choice index, delta) as each arrives; raises the first KvgridError any choice raises.

    Deltas that queued up while the consumer was busy (a client reading slower than tokens arrive) come
    out merged, one per choice, so a slow SSE stream sends fewer, larger chunks; a lone delta is never held.
    ``final_only`` (an answer sent once, at the end): each choice comes out as one delta, at its end, unless
    siblings wait for its first output (``generation.generate``'s ``final_only``).
    """
    queue: asyncio.Queue = asyncio.Queue()
    cached: dict[int, asyncio.Event] = {}  # prompt index -> set once its leader produced output
    final_only = final_only and all(choice.leader for choice in choices)
    tasks = []
    for choice in choices:
        event = cached.setdefault(choice.prompt_index, asyncio.Event())
        tasks.append(asyncio.create_task(_run_one(pipe, choice, event, queue, final_only)))
    remaining = len(tasks)
    try:
        while remaining:
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            merged: dict[int, generate_pb2.GenerateResponse] = {}  # choice index -> its queued deltas as one
            error = None
            for index, item in ready:
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    error = error or item
                else:
                    merged[index] = merge([merged.get(index), item])
            for index, out in merged.items():
                yield index, out
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _run_one(
    pipe: Pipeline, choice: Choice, prompt_cached: asyncio.Event, queue: asyncio.Queue, final_only: bool
) -> None:
    try:
        if not choice.leader:
            await prompt_cached.wait()
        with RequestMetrics(pipe.metrics, choice.request.request_id) as tracked:
            stream = generate(
                pipe.engine,
                pipe.tokenizer,
                choice.request,
                parent_context=pipe.parent_context,
                tracked=tracked,
                final_only=final_only,
            )
            async with contextlib.aclosing(stream):
                async for out in stream:
                    prompt_cached.set()
                    queue.put_nowait((choice.index, out))
        queue.put_nowait((choice.index, None))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
        queue.put_nowait((choice.index, exc))
    finally:
        prompt_cached.set()  # a failed leader must not hold its siblings forever
