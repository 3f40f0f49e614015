"""kvgrid.v1.TextGeneration: validate and tokenize, stream the scheduler's tokens back as text."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc
from services.common.errors import InvalidArgument, grpc_errors
from services.common.tracing import context_from_metadata
from services.tokenizer import validation as v
from services.tokenizer.embedding import embed
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.frontdoor import ChatPrompt, Prompt, TextPrompt, TokensPrompt, tokenize_async
from services.tokenizer.generation import generate
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.model_state import ModelState
from services.tokenizer.openai.tools.proto import ToolCallDeltas, chat_prompt_from_proto, messages_from_proto
from services.tokenizer.request_metrics import RequestMetrics


class TextGenerationServicer(generate_pb2_grpc.TextGenerationServicer):
    def __init__(self, state: ModelState, engine: EngineClient, metrics: TokenizerMetrics):
        self._state = state
        self._engine = engine
        self._metrics = metrics

    @grpc_errors
    async def Generate(self, request: generate_pb2.GenerateRequest, context) -> AsyncIterator:
        with RequestMetrics(self._metrics, request.request_id) as tracked:
            if request.prompt and request.prompt_token_ids:
                raise InvalidArgument("prompt", "set exactly one of prompt and prompt_token_ids, not both")
            if not request.prompt and not request.prompt_token_ids:
                raise InvalidArgument("prompt", "empty: set prompt (text) or prompt_token_ids")
            if request.prompt_token_ids:
                prompt = TokensPrompt(list(request.prompt_token_ids))
            else:
                prompt = TextPrompt(request.prompt)
            async for out in self._run(request, prompt, context, tracked):
                yield out

    @grpc_errors
    async def Chat(self, request: generate_pb2.ChatRequest, context) -> AsyncIterator:
        with RequestMetrics(self._metrics, request.request_id) as tracked:
            async for out in self._run(request, chat_prompt_from_proto(request), context, tracked):
                yield out

    @grpc_errors
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context) -> generate_pb2.TokenizeResponse:
        tokenizer = self._state.require_tokenizer()
        if request.messages:
            prompt = ChatPrompt(messages_from_proto(request.messages))
        else:
            prompt = TextPrompt(request.text, "text", request.add_special_tokens)
        token_ids = await tokenize_async(tokenizer, prompt, self._state.max_prompt_chars())
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

    @grpc_errors
    async def Embed(self, request: generate_pb2.EmbedRequest, context) -> generate_pb2.EmbedResponse:
        if request.input and request.input_token_ids:
            raise InvalidArgument("input", "set exactly one of input and input_token_ids, not both")
        prompts: list[Prompt] = [TextPrompt(text, f"input[{i}]") for i, text in enumerate(request.input)]
        prompts += [
            TokensPrompt(list(ids.token_ids), f"input_token_ids[{i}]") for i, ids in enumerate(request.input_token_ids)
        ]
        door = self._state.front_door()
        request_id = request.request_id or uuid.uuid4().hex
        with RequestMetrics(self._metrics, request_id) as tracked, _counted(self._state):
            prepared = await door.prepare_pooling_async(prompts, request.pooling, request_id)
            parent = context_from_metadata(context)
            result = await embed(self._engine, prepared, request_id=request_id, parent_context=parent, tracked=tracked)
        return generate_pb2.EmbedResponse(
            data=[generate_pb2.Embedding(index=i, embedding=vector) for i, vector in enumerate(result.vectors)],
            usage=common_pb2.Usage(prompt_tokens=result.num_prompt_tokens),
            request_id=request_id,
        )

    async def _run(self, request, prompt: Prompt, context, tracked: RequestMetrics) -> AsyncIterator:
        """A Generate or Chat request through the front door and the engine (its own id, or a new one); a chat
        whose tools are active has its output read for calls."""
        door = self._state.front_door()
        lora = self._state.loras.resolve(request.lora_name)  # NOT_FOUND for an unknown adapter, before any work
        prepared = await door.prepare_async(prompt, request.sampling, request.request_id or uuid.uuid4().hex)
        prepared.lora = lora
        calls = ToolCallDeltas(prepared.tool_parser) if prepared.tool_parser is not None else None
        stream = generate(
            self._engine,
            door.tokenizer,
            prepared,
            parent_context=context_from_metadata(context),
            tracked=tracked,
        )
        with _counted(self._state):  # generators nested directly: each level costs per response
            async with contextlib.aclosing(stream):
                async for out in stream:
                    yield out if calls is None else calls.apply(out)


@contextlib.contextmanager
def _counted(state: ModelState):
    """The stream counts among those a drain waits for until it ends."""
    state.stream_started()
    try:
        yield
    finally:
        state.stream_ended()
