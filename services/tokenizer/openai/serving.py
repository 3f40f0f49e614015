"""The OpenAI routes' work: a request through ``prepare`` (the front door), its choices run, the answer
whole or as SSE. Everything a request may get wrong is checked before anything is submitted."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvgrid.v1.common_pb2 import LoraRequest
from services.common.errors import KvgridError
from services.common.tracing import extract
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.frontdoor import FrontDoor
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.model_state import ModelState
from services.tokenizer.openai.choices import Pipeline, run_choices
from services.tokenizer.openai.embeddings import EmbeddingRequest, EmbeddingResponse, serve_embeddings
from services.tokenizer.openai.errors import sse_error
from services.tokenizer.openai.prepare import PreparedOpenAI, check_model, prepare_chat, prepare_completion
from services.tokenizer.openai.protocol import ChatCompletionRequest, CompletionRequest
from services.tokenizer.openai.render import Renderer


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class OpenAIServing:
    def __init__(self, state: ModelState, engine: EngineClient, metrics: TokenizerMetrics):
        self.state = state
        self.engine = engine
        self.metrics = metrics

    def served_model(self, asked: str | None = None) -> str:
        return check_model(asked, self.state.model_info().model)

    def generation_model(self, asked: str | None) -> tuple[str, LoraRequest | None]:
        """The name a generation answers with and the LoRA adapter it runs (``model`` naming an adapter); 404 for a
        name that is neither the base model nor an adapter."""
        served = self.state.model_info().model
        if asked and asked != served and self.state.loras.has(asked):
            return asked, self.state.loras.resolve(asked)
        return check_model(asked, served), None

    async def completions(self, req: CompletionRequest, raw: Request):
        door = self.state.front_door()
        model, lora = self.generation_model(req.model)
        prepared = await prepare_completion(req, door, model)
        return await self._answer(raw, door, with_lora(prepared, lora))

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        door = self.state.front_door()
        model, lora = self.generation_model(req.model)
        prepared = await prepare_chat(req, door, model)
        return await self._answer(raw, door, with_lora(prepared, lora))

    async def embeddings(self, req: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        door = self.state.front_door()
        model = check_model(req.model, self.served_model())
        self.state.stream_started()  # a drain waits for it
        try:
            return await until_disconnected(raw, serve_embeddings(req, door, self.engine, model, raw, self.metrics))
        finally:
            self.state.stream_ended()

    async def _answer(self, raw: Request, door: FrontDoor, prepared: PreparedOpenAI):
        pipe = Pipeline(self.engine, door.tokenizer, self.metrics, extract(raw.headers))
        renderer = prepared.renderer
        deltas = self.state.counted(run_choices(pipe, prepared.choices, not prepared.stream))  # a drain waits for it
        if not prepared.stream:
            async with contextlib.aclosing(deltas):
                await until_disconnected(raw, _collect(renderer, deltas))
            return JSONResponse(renderer.response().model_dump())
        try:  # the first delta (or error) before the headers: an error is still an HTTP status
            first = await until_disconnected(raw, anext(deltas, None))
        except BaseException:
            await deltas.aclose()
            raise
        stream = _sse(renderer, first, deltas, prepared.include_usage)
        return StreamingResponse(stream, media_type="text/event-stream")


def with_lora(prepared: PreparedOpenAI, lora: LoraRequest | None) -> PreparedOpenAI:
    for choice in prepared.choices:
        choice.request.lora = lora
    return prepared


async def _collect(renderer: Renderer, deltas) -> None:
    async for index, delta in deltas:
        renderer.add(index, delta)


async def until_disconnected(raw: Request, work: Awaitable):
    """``work``'s result; if the client disconnects first, ``work`` is cancelled (aborting what it started)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def _sse(renderer: Renderer, first, deltas, include_usage: bool) -> AsyncIterator[str]:
    """One ``data:`` event per chunk, the usage chunk if asked, ``[DONE]``. Cancelled when the client goes
    away: closing ``deltas`` aborts every choice upstream."""
    async with contextlib.aclosing(deltas):
        try:
            item = first
            while item is not None:
                chunk = renderer.chunk(*item)
                if chunk is not None:
                    yield f"data: {chunk}\n\n"
                item = await anext(deltas, None)
            if include_usage:
                yield f"data: {renderer.usage_chunk()}\n\n"
        except KvgridError as exc:
            yield sse_error(exc)
    yield "data: [DONE]\n\n"
