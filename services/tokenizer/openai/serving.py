"""The OpenAI routes' work: check and tokenize a request, run its choices, answer whole or as SSE.

Everything a request may get wrong is checked before anything is submitted, with the gRPC API's checks;
a failure raises ``KvgridError`` carrying ``public_field``, the request's own name of the bad field.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvgrid.v1 import generate_pb2
from services.common.errors import InvalidArgument, KvgridError
from services.common.tracing import extract
from services.tokenizer import validation as v
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.model_state import ModelState
from services.tokenizer.openai import params as p
from services.tokenizer.openai.choices import Pipeline, plan_choices, run_choices
from services.tokenizer.openai.errors import ModelNotFound, sse_error
from services.tokenizer.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from services.tokenizer.openai.render import Renderer
from services.tokenizer.prompts import encode_chat, encode_text

ROLES = {"developer": "system"}  # OpenAI's newer name for the system role


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class OpenAIServing:
    def __init__(self, state: ModelState, engine: EngineClient, metrics: TokenizerMetrics):
        self.state = state
        self.engine = engine
        self.metrics = metrics

    def served_model(self, asked: str | None = None) -> str:
        served = self.state.model_info().model
        if asked and asked != served:
            raise ModelNotFound(asked, served)
        return served

    async def completions(self, req: CompletionRequest, raw: Request):
        model = self.served_model(req.model)
        tokenizer, limits = self.state.require_serving()
        fields = _named(lambda: p.completion_sampling(req), None)
        _named(lambda: v.check_sampling(fields.params, limits), fields)
        request_id = _request_id(req.request_id)
        prompts, echo = await self._completion_prompts(req, tokenizer, limits)
        renderer = Renderer(False, request_id, model, req.n, p.num_top_logprobs(req), echo)
        pipe = Pipeline(self.engine, tokenizer, limits, self.metrics, extract(raw.headers))
        return await self._answer(raw, req.stream, req.include_usage, renderer, pipe, prompts, fields, request_id)

    async def chat(self, req: ChatCompletionRequest, raw: Request):
        model = self.served_model(req.model)
        tokenizer, limits = self.state.require_serving()
        fields = _named(lambda: p.chat_sampling(req, limits), None)
        _named(lambda: v.check_sampling(fields.params, limits), fields)
        request_id = _request_id(req.request_id)
        messages = chat_messages(req.messages)
        prompt_ids = await encode_chat(tokenizer, messages)
        v.check_prompt_length("messages", len(prompt_ids), limits)
        renderer = Renderer(True, request_id, model, req.n, p.num_top_logprobs(req), {})
        pipe = Pipeline(self.engine, tokenizer, limits, self.metrics, extract(raw.headers))
        return await self._answer(raw, req.stream, req.include_usage, renderer, pipe, [prompt_ids], fields, request_id)

    async def _completion_prompts(self, req: CompletionRequest, tokenizer, limits) -> tuple[list[list[int]], dict]:
        """Token ids of each prompt, and the echoed text of each (prompt index -> text) when ``echo``."""
        prompt = req.prompt
        batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
        items = prompt if batch else [prompt]
        out, echo = [], {}
        for i, item in enumerate(items):
            field = f"prompt[{i}]" if batch else "prompt"
            if isinstance(item, str):
                if not item:
                    raise InvalidArgument(field, "empty: give text or token ids")
                ids = await encode_text(tokenizer, item)
            else:
                ids = list(item)
                v.check_token_ids(field, ids, limits.vocab_size)
            v.check_prompt_length(field, len(ids), limits)
            out.append(ids)
            if req.echo:
                echo[i] = item if isinstance(item, str) else tokenizer.decode(ids, skip_special_tokens=False)
        return out, echo

    async def _answer(self, raw, stream, include_usage, renderer, pipe, prompts, fields, request_id):
        choices = plan_choices(request_id, prompts, fields.params, renderer.n)
        deltas = self.state.counted(run_choices(pipe, choices))  # a drain waits for it
        if not stream:
            async with contextlib.aclosing(deltas):
                await until_disconnected(raw, _collect(renderer, deltas))
            return JSONResponse(renderer.response().model_dump())
        try:  # the first delta (or error) before the headers: an error is still an HTTP status
            first = await until_disconnected(raw, anext(deltas, None))
        except BaseException:
            await deltas.aclose()
            raise
        return StreamingResponse(_sse(renderer, first, deltas, include_usage), media_type="text/event-stream")


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Checked as the gRPC Chat checks its messages; text parts are joined."""
    out = [generate_pb2.ChatMessage(role=ROLES.get(m.role, m.role), content=m.text()) for m in messages]
    v.check_messages("messages", out)
    return [{"role": m.role, "content": m.content} for m in out]


def _request_id(given: str | None) -> str:
    if given is None:
        return uuid.uuid4().hex
    v.check_request_id(given)
    return given


def _named(check, fields: p.SamplingFields | None):
    """Run ``check``; an InvalidArgument leaves with the client's name of its field in ``public_field``."""
    try:
        return check()
    except InvalidArgument as exc:
        exc.public_field = fields.public_field(exc.field) if fields is not None else exc.field
        raise


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
