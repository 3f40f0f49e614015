"""The frontend's HTTP app (FastAPI): the OpenAI-compatible API, vLLM's /tokenize and /detokenize, and the
operator's /health and /metrics."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.common.errors import KvgridError
from services.tokenizer import validation as v
from services.tokenizer.frontdoor import ChatPrompt, TextPrompt, tokenize_async
from services.tokenizer.openai import errors
from services.tokenizer.openai.prepare import chat_messages
from services.tokenizer.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from services.tokenizer.openai.responses import ModelCard, ModelList
from services.tokenizer.openai.serving import ClientGone, OpenAIServing


def build_app(serving: OpenAIServing, registry: CollectorRegistry, is_serving: Callable[[], bool]) -> FastAPI:
    app = FastAPI(title="kvgrid", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(KvgridError, errors.kvgrid_error_handler)
    app.add_exception_handler(RequestValidationError, errors.validation_error_handler)
    app.add_exception_handler(ClientGone, lambda request, exc: Response(status_code=499))
    app.add_exception_handler(Exception, errors.internal_error_handler)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> PlainTextResponse:
        if is_serving():
            return PlainTextResponse("SERVING\n")
        return PlainTextResponse("NOT_SERVING\n", status_code=503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        info = serving.state.model_info()
        card = ModelCard(id=info.model, created=0, root=info.model, max_model_len=info.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request):
        return await serving.chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        serving.served_model(body.model)
        tokenizer = serving.state.require_tokenizer()
        if body.messages is not None:
            prompt = ChatPrompt(chat_messages(body.messages))
        else:
            prompt = TextPrompt(body.prompt or "", "prompt", body.add_special_tokens)
        token_ids = await tokenize_async(tokenizer, prompt)
        max_len = serving.state.limits().max_model_len
        return JSONResponse({"count": len(token_ids), "max_model_len": max_len, "tokens": token_ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        serving.served_model(body.model)
        tokenizer = serving.state.require_tokenizer()
        v.check_token_ids("tokens", body.tokens, serving.state.limits().vocab_size)
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    return app
