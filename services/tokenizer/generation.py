"""One request through the frontend pipeline: submit, detokenize, stop strings, metrics, tracing, upstream abort.

Used by the gRPC servicer, the OpenAI routes and the router alike, so every
entry point streams the same deltas and frees the request upstream the same way.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from opentelemetry.trace import Status, StatusCode

from kvgrid.v1 import common_pb2, generate_pb2
from services.common.errors import Unavailable
from services.common.logs import request_log
from services.common.tracing import inject, trace_id_hex, tracer
from services.tokenizer import validation as v
from services.tokenizer.engine_client import EngineClient
from services.tokenizer.output import OutputProcessor
from services.tokenizer.request_metrics import RequestMetrics
from services.tokenizer.text_tokenizer import TextTokenizer

log = logging.getLogger(__name__)


async def generate(
    engine: EngineClient,
    tokenizer: TextTokenizer,
    limits: v.ModelLimits,
    request_id: str,
    prompt_ids: list[int],
    sampling: common_pb2.SamplingParams,
    *,
    parent_context=None,
    tracked: RequestMetrics | None = None,
) -> AsyncIterator[generate_pb2.GenerateResponse]:
    """Yield the public deltas of one validated request (``sampling`` as the client sent it).

    The last response has finish_reason and usage set. Closing the iterator early or
    cancelling the consuming task aborts the request upstream. Raises KvgridError subclasses.
    """
    output = OutputProcessor(tokenizer, request_id, prompt_ids, sampling)
    span = tracer().start_span(
        "tokenizer.generate",
        context=parent_context,
        attributes={"kvgrid.request_id": request_id, "kvgrid.prompt_tokens": len(prompt_ids)},
    )
    upstream = v.submit_sampling(sampling, len(prompt_ids), limits)
    handle = await engine.submit(request_id, prompt_ids, upstream, inject(span))
    if tracked is not None:
        tracked.begin(request_id, len(prompt_ids), trace_id_hex(span))
    try:
        async for delta in handle:
            out = output.process(delta)
            if output.stopped_by_string:
                # Awaited before answering: once the client sees the end, the scheduler holds nothing under
                # this id, so a request reusing it at once is neither refused nor hit by a late abort.
                await handle.stop()
            if out is not None:
                if tracked is not None:
                    tracked.output(len(out.token_ids))
                yield out
            if output.finished:
                break
        if not output.finished:
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
