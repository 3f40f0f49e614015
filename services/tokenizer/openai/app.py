"""The frontend's HTTP app (FastAPI): the OpenAI-compatible API, vLLM's /tokenize and /detokenize, the
operator's /health and /metrics, and the API's OpenAPI schema at /openapi.json. ``guards`` puts the API key and
body-size checks in front of it."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.config_requests import ResponsesConfig
from services.common.errors import KvgridError
from services.tokenizer import validation as v
from services.tokenizer.frontdoor import ChatPrompt, TextPrompt, tokenize_async
from services.tokenizer.openai import errors
from services.tokenizer.openai.embeddings import EmbeddingRequest, EmbeddingResponse
from services.tokenizer.openai.guards import HttpGuards, LimitBody, RequireApiKey
from services.tokenizer.openai.lora_routes import add_lora_routes
from services.tokenizer.openai.prepare import chat_messages
from services.tokenizer.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.tokenizer.openai.responses import ErrorResponse, ModelCard, ModelList
from services.tokenizer.openai.responses_api import objects as o
from services.tokenizer.openai.responses_api.protocol import ResponsesRequest
from services.tokenizer.openai.responses_api.serving import ResponsesServing
from services.tokenizer.openai.responses_api.store import ResponseStore
from services.tokenizer.openai.serving import ClientGone, OpenAIServing

# What the schema (/openapi.json) says every API route may answer besides its 200: OpenAI's error object.
ERRORS = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in (
        (400, "a field is invalid or not supported; `param` names it"),
        (401, "no API key, or a wrong one"),
        (404, "no such model, or no stored response of that id"),
        (413, "the body is larger than --max-request-bytes"),
        (429, "the queues are full"),
        (503, "no scheduler is ready yet, or the frontend is shutting down"),
    )
}
# Generation routes answer JSON, or server-sent events with `stream: true`.
STREAMED = {**ERRORS, 200: {"content": {"application/json": {}, "text/event-stream": {}}}}
STORED = {**ERRORS, 200: {"model": o.Response}}


def build_app(
    serving: OpenAIServing,
    registry: CollectorRegistry,
    is_serving: Callable[[], bool],
    guards: HttpGuards | None = None,
    store: ResponseStore | None = None,
) -> FastAPI:
    """``store``: the Responses API's store of finished responses (default: ``ResponsesConfig``'s bounds)."""
    guards = guards or HttpGuards()
    if store is None:
        store = ResponseStore.from_config(ResponsesConfig())
    responses = ResponsesServing(serving, store)
    app = FastAPI(title="kvgrid", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    # The last added runs first: the key is checked before any of the body is read.
    app.add_middleware(LimitBody, max_bytes=guards.max_body_bytes)
    if guards.api_keys is not None:
        app.add_middleware(RequireApiKey, keys=guards.api_keys, metrics_require_key=guards.metrics_require_key)
    app.add_exception_handler(KvgridError, errors.kvgrid_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, errors.http_error_handler)
    app.add_exception_handler(ClientGone, lambda request, exc: Response(status_code=499))
    app.add_exception_handler(Exception, errors.internal_error_handler)

    # The operator's routes stay out of the API's schema (/openapi.json).
    @app.api_route("/health", methods=["GET", "HEAD"], include_in_schema=False)
    async def health() -> PlainTextResponse:
        if is_serving():
            return PlainTextResponse("SERVING\n")
        return PlainTextResponse("NOT_SERVING\n", status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"], include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=ERRORS)
    async def models() -> JSONResponse:
        info = serving.state.model_info()
        card = ModelCard(
            id=info.model,
            created=0,
            root=info.model,
            max_model_len=info.max_model_len,
            runner=info.runner,
            supported_tasks=list(info.supported_tasks),
        )
        adapters = [
            card.model_copy(update={"id": name, "root": serving.state.loras.path(name), "parent": info.model})
            for name in serving.state.loras.names()
        ]
        return JSONResponse(ModelList(data=[card, *adapters]).model_dump())

    if serving.state.loras.allow_runtime:
        add_lora_routes(app, serving)

    @app.post("/v1/completions", responses=STREAMED)
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", responses=STREAMED)
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    @app.post("/v1/embeddings", responses=ERRORS)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> EmbeddingResponse:
        return await serving.embeddings(body, raw)

    @app.post("/v1/responses", responses=STREAMED)
    async def create_response(body: ResponsesRequest, raw: Request):
        return await responses.create(body, raw)

    @app.get("/v1/responses/{response_id}", responses=STORED)
    async def get_response(response_id: str) -> JSONResponse:
        return responses.get(response_id)

    @app.delete("/v1/responses/{response_id}", responses={**ERRORS, 200: {"model": o.DeletedResponse}})
    async def delete_response(response_id: str) -> JSONResponse:
        return responses.delete(response_id)

    @app.post("/tokenize", responses=ERRORS)
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        serving.served_model(body.model)
        tokenizer = serving.state.require_tokenizer()
        if body.messages is not None:
            prompt = ChatPrompt(chat_messages(body.messages))
        else:
            prompt = TextPrompt(body.prompt or "", "prompt", body.add_special_tokens)
        token_ids = await tokenize_async(tokenizer, prompt, serving.state.max_prompt_chars())
        max_len = serving.state.limits().max_model_len
        return JSONResponse({"count": len(token_ids), "max_model_len": max_len, "tokens": token_ids})

    @app.post("/detokenize", responses=ERRORS)
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        serving.served_model(body.model)
        tokenizer = serving.state.require_tokenizer()
        v.check_token_ids("tokens", body.tokens, serving.state.limits().vocab_size)
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    return app
