"""The ``/v1/responses`` routes' work: a request translated onto the chat path (the front door's ``prepare_chat``
and the same pipeline), its answer as a Response or as typed events, and the store behind ``GET``/``DELETE``
and ``previous_response_id``. Everything a request may get wrong is checked before anything is submitted."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.common.errors import InvalidArgument, KvgridError, NotFound
from services.common.tracing import extract
from services.tokenizer.openai.choices import Pipeline, run_choices
from services.tokenizer.openai.prepare import PreparedOpenAI, prepare_chat
from services.tokenizer.openai.render import Renderer
from services.tokenizer.openai.responses_api import objects as o
from services.tokenizer.openai.responses_api.events import EventWriter
from services.tokenizer.openai.responses_api.output import base_response, conversation_items, finish, output_items
from services.tokenizer.openai.responses_api.protocol import ResponsesRequest
from services.tokenizer.openai.responses_api.store import ResponseStore, StoredResponse
from services.tokenizer.openai.responses_api.translate import ChatTranslation, canonical_items, chat_translation
from services.tokenizer.openai.serving import OpenAIServing, until_disconnected


class ResponseNotFound(NotFound):
    def __init__(self, response_id: str, field: str | None = None):
        super().__init__(f"no stored response with id {response_id!r} (it expired, was deleted, or was not stored)")
        if field is not None:
            self.public_field = field


class ResponsesServing:
    def __init__(self, serving: OpenAIServing, store: ResponseStore):
        self.serving = serving
        self.store = store

    async def create(self, req: ResponsesRequest, raw: Request):
        state = self.serving.state
        door = state.front_door()
        model = self.serving.served_model(req.model)
        history = self._history(req.previous_response_id)
        request_id = uuid.uuid4().hex
        items = canonical_items(req.input)
        translation = chat_translation(req, history, items, request_id)
        prepared = await _prepare(translation, door, model)
        response = base_response(req, f"resp_{request_id}", model, req.store and self.store.enabled)
        conversation = history + items
        pipe = Pipeline(self.serving.engine, door.tokenizer, self.serving.metrics, extract(raw.headers))
        deltas = state.counted(run_choices(pipe, prepared.choices, not req.stream))  # a drain waits for it
        renderer = prepared.renderer
        if not req.stream:
            async with contextlib.aclosing(deltas):
                await until_disconnected(raw, _collect(renderer, deltas))
            chat = renderer.response().model_dump()
            choice = chat["choices"][0]
            finish(response, output_items(choice["message"]), choice["finish_reason"], chat["usage"])
            self._keep(response, conversation)
            return JSONResponse(response.model_dump())
        try:  # the first delta (or error) before the headers: an error is still an HTTP status
            first = await until_disconnected(raw, anext(deltas, None))
        except BaseException:
            await deltas.aclose()
            raise
        events = self._events(EventWriter(response), renderer, first, deltas, conversation)
        return StreamingResponse(events, media_type="text/event-stream")

    def get(self, response_id: str) -> JSONResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise ResponseNotFound(response_id)
        return JSONResponse(entry.response)

    def delete(self, response_id: str) -> JSONResponse:
        if not self.store.delete(response_id):
            raise ResponseNotFound(response_id)
        return JSONResponse(o.DeletedResponse(id=response_id).model_dump())

    def _history(self, previous_response_id: str | None) -> list[dict]:
        if previous_response_id is None:
            return []
        entry = self.store.get(previous_response_id)
        if entry is None:
            raise ResponseNotFound(previous_response_id, "previous_response_id")
        return list(entry.conversation)

    def _keep(self, response: o.Response, conversation: list[dict]) -> None:
        if response.store:
            entry = StoredResponse(response.model_dump(), conversation + conversation_items(response.output))
            self.store.put(response.id, entry)

    async def _events(
        self, writer: EventWriter, renderer: Renderer, first, deltas, conversation: list[dict]
    ) -> AsyncIterator[str]:
        """The typed events, the response stored before the last one. Cancelled when the client goes away:
        closing ``deltas`` aborts the request upstream, and nothing is stored."""
        async with contextlib.aclosing(deltas):
            for event in writer.start():
                yield event
            try:
                item = first
                while item is not None:
                    chunk = renderer.chunk(*item)
                    if chunk is not None:
                        for event in writer.chunk(json.loads(chunk)):
                            yield event
                    item = await anext(deltas, None)
            except KvgridError as exc:
                for event in writer.fail(exc):
                    yield event
                return
        events, response = writer.end(renderer.usage().model_dump())
        self._keep(response, conversation)
        for event in events:
            yield event


async def _prepare(translation: ChatTranslation, door, model: str) -> PreparedOpenAI:
    """``prepare_chat``; an invalid field leaves named as the Responses request names it."""
    try:
        return await prepare_chat(translation.chat, door, model)
    except InvalidArgument as exc:
        exc.public_field = translation.public_field(getattr(exc, "public_field", None) or exc.field)
        raise


async def _collect(renderer: Renderer, deltas) -> None:
    async for index, delta in deltas:
        renderer.add(index, delta)
