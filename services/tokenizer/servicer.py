"""kvgrid.v1.TextGeneration: validate and tokenize, stream the scheduler's tokens back as text."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from opentelemetry.trace import Status, StatusCode

from kvgrid.v1 import common_pb2, generate_pb2, generate_pb2_grpc, scheduler_pb2
from services.common.errors import InvalidArgument, KvgridError, Unavailable, grpc_errors
from services.common.logs import request_log
from services.common.metrics import TokenizerMetrics
from services.common.tracing import context_from_metadata, inject, trace_id_hex, tracer
from services.tokenizer import validation as v
from services.tokenizer.model_state import ModelState
from services.tokenizer.output import OutputProcessor
from services.tokenizer.request_metrics import RequestMetrics
from services.tokenizer.text_tokenizer import TextTokenizer
from services.tokenizer.upstream import SchedulerLink

log = logging.getLogger(__name__)

LONG_INPUT_CHARS = 8192


async def _off_loop(fn, value, num_chars: int, **kwargs):
    """Tokenize long inputs in a thread so that one big prompt does not stall every other stream."""
    if num_chars < LONG_INPUT_CHARS:
        return fn(value, **kwargs)
    return await asyncio.to_thread(fn, value, **kwargs)


class SchedulerError(KvgridError):
    """A failed Submit: the client gets the scheduler's status code, with where it came from."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


def _messages(messages) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.content} for m in messages]


class TextGenerationServicer(generate_pb2_grpc.TextGenerationServicer):
    def __init__(self, state: ModelState, link: SchedulerLink, metrics: TokenizerMetrics):
        self._state = state
        self._link = link
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
                field, prompt_ids = "prompt", await _off_loop(tokenizer.encode, request.prompt, len(request.prompt))
            v.check_prompt_length(field, len(prompt_ids), limits)
            stream = self._stream(tokenizer, limits, request.request_id, prompt_ids, request.sampling, context, tracked)
            async for out in stream:
                yield out

    @grpc_errors
    async def Chat(self, request: generate_pb2.ChatRequest, context) -> AsyncIterator:
        with RequestMetrics(self._metrics, request.request_id) as tracked:
            v.check_request_id(request.request_id)
            v.check_messages("messages", request.messages)
            tokenizer, limits = self._state.require_serving()
            v.check_sampling(request.sampling, limits)
            prompt_ids = await self._encode_chat(tokenizer, request.messages)
            v.check_prompt_length("messages", len(prompt_ids), limits)
            stream = self._stream(tokenizer, limits, request.request_id, prompt_ids, request.sampling, context, tracked)
            async for out in stream:
                yield out

    @grpc_errors
    async def Tokenize(self, request: generate_pb2.TokenizeRequest, context) -> generate_pb2.TokenizeResponse:
        tokenizer = self._state.require_tokenizer()
        if request.messages:
            v.check_messages("messages", request.messages)
            token_ids = await self._encode_chat(tokenizer, request.messages)
        else:
            add = request.add_special_tokens
            token_ids = await _off_loop(tokenizer.encode, request.text, len(request.text), add_special_tokens=add)
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

    @staticmethod
    async def _encode_chat(tokenizer: TextTokenizer, messages) -> list[int]:
        if tokenizer.chat_template is None:
            raise InvalidArgument("messages", "the model's tokenizer has no chat template; use Generate with a prompt")
        num_chars = sum(len(m.content) for m in messages)
        return await _off_loop(tokenizer.encode_chat, _messages(messages), num_chars)

    async def _stream(
        self,
        tokenizer: TextTokenizer,
        limits: v.ModelLimits,
        request_id: str,
        prompt_ids: list[int],
        sampling: common_pb2.SamplingParams,
        context,
        tracked: RequestMetrics,
    ) -> AsyncIterator[generate_pb2.GenerateResponse]:
        request_id = request_id or uuid.uuid4().hex
        output = OutputProcessor(tokenizer, request_id, prompt_ids, sampling)
        submit = scheduler_pb2.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=prompt_ids,
            sampling=v.submit_sampling(sampling, len(prompt_ids), limits),
        )
        span = tracer().start_span(
            "tokenizer.generate",
            context=context_from_metadata(context),
            attributes={"kvgrid.request_id": request_id, "kvgrid.prompt_tokens": len(prompt_ids)},
        )
        call = self._link.stub.Submit(submit, metadata=list(inject(span).items()))
        upstream_done = False  # the scheduler no longer holds the request: nothing to abort
        tracked.begin(request_id, len(prompt_ids), trace_id_hex(span))
        self._state.stream_started()
        try:
            async for delta in call:
                out = output.process(delta)
                if output.stopped_by_string and not upstream_done:
                    # Awaited before answering: once the client sees the end, the scheduler holds nothing under
                    # this id, so a request reusing it at once is neither refused nor hit by a late Abort.
                    call.cancel()
                    await self._link.abort(request_id)
                    upstream_done = True
                upstream_done = upstream_done or output.finished_upstream
                if out is not None:
                    tracked.output(len(out.token_ids))
                    yield out
                if output.finished:
                    break
            if not output.finished:
                upstream_done = True
                raise Unavailable(f"the scheduler ended request {request_id} without a finish reason")
            tracked.finish(output.finish_reason)
            span.set_attribute("kvgrid.finish_reason", output.finish_reason)
        except grpc.aio.AioRpcError as e:
            upstream_done = True
            span.set_status(Status(StatusCode.ERROR, f"{e.code().name}: {e.details()}"))
            raise SchedulerError(e.code(), f"scheduler at {self._link.addr}: {e.details() or e.code().name}") from e
        except Exception as e:
            span.set_status(Status(StatusCode.ERROR, str(e)))
            raise
        finally:
            if not upstream_done:  # client cancelled or disconnected, or an error here
                self._end_upstream(call, request_id)
            span.set_attribute("kvgrid.completion_tokens", output.num_output_tokens)
            span.end()
            self._state.stream_ended()

    def _end_upstream(self, call, request_id: str) -> None:
        """Stop the request at the scheduler now; synchronous, so it also works while the handler is cancelled."""
        request_log(log, request_id).debug("ending the request upstream")
        call.cancel()
        self._link.abort_later(request_id)
