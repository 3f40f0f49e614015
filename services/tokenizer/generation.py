"""One request through the frontend pipeline: submit, detokenize, stop strings, metrics, tracing, upstream abort.

Used by the gRPC servicer, the OpenAI routes and the router alike, so every
entry point streams the same deltas and frees the request upstream the same way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from opentelemetry.trace import Status, StatusCode

from kvgrid.v1 import generate_pb2
from services.common.errors import Unavailable
from services.common.logs import request_log
from services.common.tracing import inject, trace_id_hex, tracer
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.frontdoor import EngineRequest
from services.tokenizer.output import OutputProcessor, merge
from services.tokenizer.request_metrics import RequestMetrics
from services.tokenizer.text_tokenizer import TextTokenizer

log = logging.getLogger(__name__)


async def generate(
    engine: EngineClient,
    tokenizer: TextTokenizer,
    request: EngineRequest,
    *,
    parent_context=None,
    tracked: RequestMetrics | None = None,
    final_only: bool = False,
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Yield the public deltas of one request from the front door.

    The last response has finish_reason and usage set. Closing the iterator early or
    cancelling the consuming task aborts the request upstream. Raises KvgridError subclasses.
    ``final_only``: for a caller that answers once, at the end (a completion that is not streamed): the deltas
    are processed as they arrive (text, stop strings, token metrics) but come out merged into one response;
    without stop strings the scheduler sends the first token, then the rest with the finish
    (``SubmitRequest.deliver_at_finish``).
    """
    request_id, prompt_ids = request.request_id, request.prompt_ids
    output = OutputProcessor(tokenizer, request_id, prompt_ids, request.sampling)
    span = tracer().start_span(
        "tokenizer.generate",
        context=parent_context,
        attributes={"kvgrid.request_id": request_id, "kvgrid.prompt_tokens": len(prompt_ids)},
    )
    extras: dict = {}  # only what the request has: engines without images or adapters take the plain call
    if request.mm_inputs:
        extras["mm_inputs"] = request.mm_inputs
    if request.lora is not None:
        extras["lora"] = request.lora
    if final_only and not request.sampling.stop:  # stop strings are matched here, as the tokens come
        extras["deliver_at_finish"] = True
    handle = await engine.submit(request_id, prompt_ids, request.scheduler_sampling(), inject(span), **extras)

    def process(delta) -> generate_pb2.GenerateResponse | None:
        out = output.process(delta)
        if output.stopped_by_string:
            handle.close()  # in order on the stream: a request reusing the id at once is not hit by it
        if final_only and out is not None and tracked is not None:
            tracked.output(len(out.token_ids))  # as the tokens arrive: time to first token and between tokens
        return out

    handle.transform = process
    handle.final_only = final_only
    if tracked is not None:
        tracked.begin(request_id, len(prompt_ids), trace_id_hex(span))
    try:
        finished = False
        async for out in handle:
            # Responses that piled up while this call waited go out as one.
            more = handle.ready()
            if more:
                out = merge([out, *more])
            if out is None:
                continue
            if tracked is not None and not final_only:
                tracked.output(len(out.token_ids))
            # Decided by what was sent: the client's pass may already have processed later deltas.
            finished = bool(out.finish_reason)
            yield out
            if finished:
                break
        if not finished:
            raise Unavailable(f"the scheduler ended request {request_id} without a finish reason")
        if tracked is not None:
            tracked.finish(output.finish_reason)
        span.set_attribute("kvgrid.finish_reason", output.finish_reason)
    except BaseException as e:
        span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
        raise
    finally:
        if not handle.done_upstream:  # client cancelled or disconnected, or an error here
            request_log(log, request_id).debug("ending the request upstream")
            handle.close()
        span.set_attribute("kvgrid.completion_tokens", output.num_output_tokens)
        span.end()
