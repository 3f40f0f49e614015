"""kvgrid.v1.TextGeneration: validate and tokenize, stream the scheduler's tokens back as text."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from kvgrid.v1 import generate_pb2, generate_pb2_grpc
from services.common.errors import InvalidArgument, grpc_errors
from services.common.tracing import context_from_metadata
from services.tokenizer import validation as v
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.generation import generate
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.model_state import ModelState
from services.tokenizer.prompts import encode_chat, encode_text
from services.tokenizer.request_metrics import RequestMetrics
from services.tokenizer.text_tokenizer import TextTokenizer


def _messages(messages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


class TextGenerationServicer(generate_pb2_grpc.TextGenerationServicer):
    def __init__(self, state: ModelState, engine: EngineClient, metrics: TokenizerMetrics):
        self._state = state
        self._engine = engine
        self._metrics = metrics

    @grpc_errors
    async def Generate(self, request: generate_pb2.GenerateRequest, context) -> AsyncIterator:
        with RequestMetrics(self._metrics, request.request_id) as tracked:
            v.check_request_id(request.request_id)
            if request.prompt and request.prompt_token_ids:
                raise InvalidArgument("prompt", "set exactly one of prompt and prompt_token_ids, not both")
            if not request.prompt and not request.prompt_token_ids:
                raise InvalidArgument("prompt", "empty: set prompt (text) or prompt_token_ids")
            tokenizer, limits = self._state.require_serving()
            v.check_sampling(request.sampling, limits)
            if request.prompt_token_ids:
                field, prompt_ids = "prompt_token_ids", list(request.prompt_token_ids)
                v.check_token_ids(field, prompt_ids, limits.vocab_size)
            else:
                field, prompt_ids = "prompt", await encode_text(tokenizer, request.prompt)
            v.check_prompt_length(field, len(prompt_ids), limits)
            stream = self._generate(tokenizer, limits, request, prompt_ids, context, tracked)
            with _counted(self._state):  # generators nested directly: each level costs per response
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        yield out

    @grpc_errors
    async def Chat(self, request: generate_pb2.ChatRequest, context) -> AsyncIterator:
        with RequestMetrics(self._metrics, request.request_id) as tracked:
            v.check_request_id(request.request_id)
            v.check_messages("messages", request.messages)
            tokenizer, limits = self._state.require_serving()
            v.check_sampling(request.sampling, limits)
            prompt_ids = await encode_chat(tokenizer, _messages(request.messages))
            v.check_prompt_length("messages", len(prompt_ids), limits)
            stream = self._generate(tokenizer, limits, request, prompt_ids, context, tracked)
            with _counted(self._state):  # generators nested directly: each level costs per response
                async with contextlib.aclosing(stream):
                    async for out in stream:
                        yield out

    @grpc_errors
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context) -> generate_pb2.TokenizeResponse:
        tokenizer = self._state.require_tokenizer()
        if request.messages:
            v.check_messages("messages", request.messages)
            token_ids = await encode_chat(tokenizer, _messages(request.messages))
        else:
            token_ids = await encode_text(tokenizer, request.text, request.add_special_tokens)
        return generate_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokenizer.token_strings(token_ids))

    @grpc_errors
    async def Detokenize(self, request: generate_pb2.DetokenizeRequest, context) -> generate_pb2.DetokenizeResponse:
        tokenizer = self._state.require_tokenizer()
        vocab_size = self._state.limits().vocab_size if self._state.info is not None else tokenizer.vocab_size
        v.check_token_ids("token_ids", request.token_ids, vocab_size)
        text = tokenizer.decode(list(request.token_ids), skip_special_tokens=not request.include_special_tokens)
        return generate_pb2.DetokenizeResponse(text=text)

    @grpc_errors
    async def GetModelInfo(self, request: generate_pb2.GetModelInfoRequest, context) -> generate_pb2.ModelInfo:
        return self._state.model_info()

    def _generate(
        self,
        tokenizer: TextTokenizer,
        limits: v.ModelLimits,
        request: generate_pb2.GenerateRequest | generate_pb2.ChatRequest,
        prompt_ids: list[int],
        context,
        tracked: RequestMetrics,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        """``generation.generate`` for a Generate or Chat request (its own id, or a new one)."""
        return generate(
            self._engine,
            tokenizer,
            limits,
            request.request_id or uuid.uuid4().hex,
            prompt_ids,
            request.sampling,
            parent_context=context_from_metadata(context),
            tracked=tracked,
        )


@contextlib.contextmanager
def _counted(state: ModelState):
    """The stream counts among those a drain waits for until it ends."""
    state.stream_started()
    try:
        yield
    finally:
        state.stream_ended()
